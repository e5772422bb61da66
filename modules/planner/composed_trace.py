"""A training step's plan composed from traces of the transformer cut to a few blocks (DESIGN.md section 10).

A Wan transformer's blocks are identical, so what a step holds grows by the same bytes with each block of a kind:
the weights, adapters, gradients and optimizer state per block, each checkpointed block's input, each swapped
block's host copy. The embeddings, the head, the optimizer's own buffers and one block's transient work do not
grow. So every number a plan reads (each phase's peak per part, the host peak, the parameter counts, the preview's
peak) is an affine function of the block count, and a few traces of a transformer cut to a few blocks, at the real
width and the real shape, give it for any count.

What makes blocks differ is kept: the blocks repeat with a period p (checkpointing every k-th block, a VACE block
every v-th, Animate's face adapter every f-th: p = lcm(k, v, f)), and block swap makes the last N blocks a suffix of
their own, with a period q = lcm(v, f) (every swapped block is checkpointed, whatever k). The real transformer is
[A periods] + [r blocks] + [the swapped suffix: B periods + s blocks], with U = L - N = p A + r and N = q B + s; the
cut ones keep r, s and the pattern, and count a = 2, 3, 4 periods (and
b = 2, 3 swapped periods; a second cut with 3, 4, 5 when the first is not linear). The peak is taken per phase
(forward, backward, optimizer step) and, in the backward pass, per section of blocks (Layout.sections): they grow
by different bytes per block, so the part that holds the peak can change with the count; each is extrapolated, then
the largest taken.

Checked, not assumed: the third trace before the swapped run must lie on the line through the first two, for every
number, else the plan is traced exactly (the whole transformer) and says why; the swapped run's line (from two
traces) and the whole method are checked by tests/test_composed_plan.py, which compares the composed plan with the
exact one, peak and parts, for every shipped preset family (and at real size, WAN_PLANNER_FULL=1: the 14B LoRA 24GB
preset equal in every number, 39 s of CPU time composed against 70 s exact on a loaded 2-core machine). A fit's
candidate settings are composed without the checking traces (`checked` False: two traces a line, not three); the
setting it answers with is composed again, checked (memory_plan.fit).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict

from modules.planner.plan_shapes import PlanShape
from modules.util.config.TrainConfig import TrainConfig

CACHE_SIZE = 256
_traces: OrderedDict = OrderedDict()   # (cut config, cut architecture, shape, setup_only) -> numbers of its trace


@dataclasses.dataclass(frozen=True)
class Layout:
    """The real transformer's blocks as periods (see the module doc)."""
    period: int
    swapped_period: int   # the swapped run's: its blocks are all checkpointed, so only VACE / face blocks repeat
    periods: int          # A: whole periods before the swapped suffix
    rest: int             # r
    swapped_periods: int  # B
    swapped_rest: int     # s
    vace_every: int = 0   # VACE: a VACE block beside every v-th block (0: none)
    start: int = 2        # the fewest periods of a run traced to extrapolate it (3: its middle kept apart too)

    @property
    def varies(self) -> int:
        """A run of more periods than this is extrapolated; one of this many or fewer is traced as it is."""
        return self.start + 2

    def blocks(self, a: int, b: int) -> int:
        return self.period * a + self.rest + self.swapped_period * b + self.swapped_rest

    def points(self, checked: bool = True) -> list[tuple[int, int]]:
        """The cut transformers traced: (a, b) of each; the first is the base (`start` periods in each run that
        varies: a run of `varies` periods or fewer before the swapped blocks, of `start` or fewer swapped, is traced
        as it is), then one and two more periods before the swapped blocks (the third checks the line), one more
        swapped period (so every swap count of one checkpointing shares the same traces). `checked` False: the
        traces that check a line are left out, and a run before the swapped blocks longer than `start` periods is
        extrapolated too (a fit's candidates: see memory_plan.fit): every swap count of one checkpointing then
        shares the same traces, also where few blocks precede the swapped ones."""
        a0, b0 = self.base(checked)
        points = [(a0, b0)]
        if self.periods > a0:   # extrapolated
            points += [(a0 + 1, b0)] + ([(a0 + 2, b0)] if checked else [])
        if self.swapped_periods > b0:
            # its line is checked by a third trace only when the unswapped run is not extrapolated (the tests
            # compare the rest with the exact plan)
            points += [(a0, b0 + 1)] + ([(a0, b0 + 2)] if checked and self.periods == a0 else [])
        return points

    def base(self, checked: bool = True) -> tuple[int, int]:
        before = self.varies if checked else self.start
        return (self.periods if self.periods <= before else self.start,
                self.swapped_periods if self.swapped_periods <= self.start else self.start)

    def sections(self, a: int, b: int) -> list[str]:
        """Each block's section of the backward pass ("": the phase's own). What a block's backward pass holds is
        linear in its place within its run (the activations of the blocks before it, the gradients of those after),
        so the peak over a run is at one of its ends, the same end for any count. The backward pass ends at a run's
        first period (all the gradients after it held): kept apart, it is the one end that grows otherwise than
        the run's start. With `start` 3 the first, the middle and the last periods of each run are kept apart
        (the ends meet the head's and the embeddings' work, which can make a middle block the peak)."""
        names = []
        for run, count, rest, period in (("P", a, self.rest, self.period),
                                         ("S", b, self.swapped_rest, self.swapped_period)):
            for m in range(count):
                if self.start < 3:
                    names += [f"{run}{q}:first" if m == 0 else "" for q in range(period)]
                    continue
                role = "first" if m == 0 else "last" if m == count - 1 else "mid"
                names += [f"{run}{q}:{role}" for q in range(period)]
            names += [f"{run}rest{q}" for q in range(rest)]
        return names


def layouts_of(config: TrainConfig, arch, checked: bool = True) -> tuple[list[Layout], str]:
    """The layouts to compose from, cheapest first ([] and why, when the run is traced whole); `checked` False: by
    the traces of a plan without its checking traces (Layout.points)."""
    c = arch.transformer
    layers = c["num_layers"]
    if arch.variant.takes_driving_video:
        # its step runs the blocks twice (the extract pass fills a cache the second pass reads): composed from cut
        # transformers its peak came out 9 % above the exact trace's (tests/test_composed_plan.py)
        return [], "Animate-2 runs its blocks twice a step (a cached pass): its plan does not compose exactly"
    swap = config.performance.block_swap
    if not 0 <= swap <= layers:
        return [], f"block swap {swap} of {layers} blocks"
    # the swapped blocks are all checkpointed (BlockCheckpointing): checkpointing every k-th sets the period of
    # the blocks before them only
    swapped_period, vace_every = 1, 0
    if c.get("vace_layers"):
        vace = list(c["vace_layers"])
        vace_every = vace[1] - vace[0] if len(vace) > 1 else layers
        if vace != list(range(0, layers, vace_every)):
            return [], f"VACE blocks at {vace} (not every n-th block from the first)"
        swapped_period = math.lcm(swapped_period, vace_every)
    if c.get("inject_face_latents_blocks"):
        swapped_period = math.lcm(swapped_period, c["inject_face_latents_blocks"])
    period = math.lcm(config.performance.checkpoint_every if config.gradient_checkpointing else 1, swapped_period)
    unswapped = layers - swap
    layouts = [Layout(period, swapped_period, unswapped // period, unswapped % period, swap // swapped_period,
                      swap % swapped_period, vace_every, start) for start in (2, 3)]
    every = f"its {layers} blocks repeat every {period} block{'s' if period > 1 else ''}"
    if len(layouts[0].points(checked)) == 1:
        return [], f"{every}: too few periods to compose"
    layouts = [layout for layout in layouts
               if len(layout.points(checked)) > 1 and _traced(layout, checked) * 3 <= layers * 2]
    if not layouts:
        return [], f"{every}: composing would trace two thirds of them or more"
    return layouts, ""


def _traced(layout: Layout, checked: bool = True) -> int:
    return sum(layout.blocks(a, b) for a, b in layout.points(checked))


def traced_blocks(config: TrainConfig, arch, checked: bool = True) -> int:
    """How many blocks a plan of the run traces (its first layout's cut transformers, else the whole one)."""
    layouts, _why = layouts_of(config, arch, checked)
    return _traced(layouts[0], checked) if layouts else arch.transformer["num_layers"]


def _cut(config: TrainConfig, arch, layout: Layout, a: int, b: int):
    """The run with its transformer cut to (a, b) periods: its config (block swap) and architecture."""
    blocks = layout.blocks(a, b)
    cut = {"num_layers": blocks}
    if layout.vace_every:
        cut["vace_layers"] = list(range(0, blocks, layout.vace_every))
    config = config.model_copy(deep=True)
    config.performance.block_swap = layout.swapped_period * b + layout.swapped_rest
    return config, dataclasses.replace(arch, transformer={**arch.transformer, **cut})


def _numbers(counter, facts: dict, setup_only: bool) -> dict:
    """Every number a plan reads from one trace, by name; the features line's integers too (`features` holds the
    line with them taken out)."""
    numbers = {("start",): counter.peak} if setup_only else {}
    if not setup_only:
        for phase, tags in counter.phase_breakdowns().items():
            for tag, value in tags.items():
                numbers[("phase", phase, tag)] = value
            numbers[("phase", phase, "")] = 0   # a phase with nothing alive still ran
        numbers[("host",)] = counter.host_peak
        if "preview" in facts:
            numbers[("preview",)] = facts["preview"][1]
    numbers[("parameters",)] = facts["parameters"]
    numbers[("trainable",)] = facts["trainable_parameters"]
    for index, value in enumerate(re.findall(r"\d+", facts["features"])):
        numbers[("feature", index)] = int(value)
    return {"numbers": numbers, "features": re.sub(r"\d+", "{}", facts["features"]),
            "preview_shape": facts["preview"][0] if "preview" in facts else None}


def _key(config: TrainConfig, arch, shape: PlanShape, setup_only: bool, sections: list[str]) -> tuple:
    return (config.model_dump_json(), repr(arch), shape, setup_only, tuple(sections))


def _trace_numbers(config: TrainConfig, arch, shape: PlanShape, setup_only: bool, sections: list[str]) -> dict:
    """One cut trace's numbers (run in a trace_pool worker, or here)."""
    from modules.planner.step_trace import trace_step
    counter, facts = trace_step(config, arch, shape, setup_only=setup_only, sections=sections)
    return _numbers(counter, facts, setup_only)


def _trace_all(jobs: list[tuple], traced) -> list[dict]:
    """The numbers of each job (_trace_numbers' arguments), those not kept from before traced side by side
    (trace_pool.py); `traced(index)` as each is known, a kept one at once."""
    from modules.planner import trace_pool
    keys = [_key(*job) for job in jobs]
    missing = [index for index, key in enumerate(keys) if key not in _traces]
    for index, key in enumerate(keys):
        if key in _traces:
            _traces.move_to_end(key)
            traced(index)
    found = {}

    def done(position: int) -> None:
        traced(missing[position])

    sizes = [jobs[i][1].transformer["num_layers"] for i in missing]
    for position, numbers in enumerate(trace_pool.run(_trace_numbers, [jobs[i] for i in missing], done, sizes)):
        found[keys[missing[position]]] = numbers
    results = [found.get(key) or _traces[key] for key in keys]
    for key, numbers in found.items():
        _traces[key] = numbers
        if len(_traces) > CACHE_SIZE:
            _traces.popitem(last=False)
    return results


@dataclasses.dataclass
class Composed:
    numbers: dict            # as _numbers(), at the real block count
    features: str
    preview_shape: object
    how: str                 # for the report: what was traced
    order: list = dataclasses.field(default_factory=list)   # the phases (and sections) in the order they ran
    checked: bool = True     # False: each line drawn through two traces, no third checked it


def compose(config: TrainConfig, arch, shape: PlanShape, setup_only: bool = False,
            progress=None, checked: bool = True) -> tuple[Composed | None, str]:
    """(the composed numbers, "") or (None, why the whole transformer must be traced). `progress(done, total,
    text)` after each cut trace (a trace kept from before counts at once). `checked` False: without the traces
    that check each line (Layout.points), so without the fallback to the next layout a failed check takes, unless
    the checking traces cost next to nothing here (`_checks_are_spare`)."""
    layouts, why = layouts_of(config, arch, checked)
    if not checked and layouts:
        strict, _why = layouts_of(config, arch)
        if strict and _checks_are_spare(config, arch, shape, strict[0], setup_only):
            checked, layouts = True, strict
    if not checked:
        layouts = layouts[:1]
    total = sum(len(layout.points(checked)) for layout in layouts)
    done = [0]

    def traced(text: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total, text)

    for layout in layouts:
        composed, why = _compose(config, arch, shape, layout, setup_only, traced, checked)
        if composed is not None:
            if progress is not None and done[0] < total:
                progress(total, total, "composed")
            return composed, ""
    return None, why


def _jobs(config: TrainConfig, arch, shape: PlanShape, layout: Layout, setup_only: bool, points) -> list[tuple]:
    """_trace_numbers' arguments for each cut transformer (a, b) of `points`."""
    return [(*_cut(config, arch, layout, a, b), shape, setup_only, layout.sections(a, b)) for a, b in points]


def _checks_are_spare(config: TrainConfig, arch, shape: PlanShape, layout: Layout, setup_only: bool) -> bool:
    """Whether the traces that check the lines end the traces no later than an eighth after those without them:
    the workers would wait for the longest trace anyway (on 2 workers, cut traces of 4, 5 and 5 blocks end at 9,
    with the check's 6 at 10), or the checking traces are kept from before. A fit then gets its candidate
    checked at that price, not by a trace of its own once the candidate is its answer."""
    from modules.planner import trace_pool

    def sizes(checked: bool) -> list[int]:
        jobs = _jobs(config, arch, shape, layout, setup_only, layout.points(checked))
        return [job[1].transformer["num_layers"] for job in jobs if _key(*job) not in _traces]

    return trace_pool.makespan(sizes(True)) * 8 <= trace_pool.makespan(sizes(False)) * 9


def _compose(config: TrainConfig, arch, shape: PlanShape, layout: Layout, setup_only: bool, traced,
             checked: bool = True):
    points = layout.points(checked)
    jobs = _jobs(config, arch, shape, layout, setup_only, points)
    texts = [f"{layout.blocks(a, b)} of {arch.transformer['num_layers']} blocks" for a, b in points]
    traces = dict(zip(points, _trace_all(jobs, lambda index: traced(texts[index]))))
    base = points[0]
    if len({t["features"] for t in traces.values()}) > 1:
        return None, "the memory features differ between the cut transformers"
    keys = set().union(*(t["numbers"] for t in traces.values()))
    value = lambda point, k: traces[point]["numbers"].get(k, 0)  # noqa: E731
    steps = []   # (the base's neighbour one period on, the real count's distance from the base)
    if layout.periods > base[0]:
        two = (base[0] + 2, base[1])
        steps.append(((base[0] + 1, base[1]), two if two in traces else None, layout.periods - base[0]))
    if layout.swapped_periods > base[1]:
        two = (base[0], base[1] + 2)
        steps.append(((base[0], base[1] + 1), two if two in traces else None, layout.swapped_periods - base[1]))
    numbers = {}
    for k in keys:
        total = value(base, k)
        for one, two, distance in steps:
            slope = value(one, k) - value(base, k)
            if two is not None and value(two, k) - value(one, k) != slope:
                return None, (f"the cut traces are not linear in the block count ({' '.join(map(str, k))}: "
                              f"{value(base, k)}, {value(one, k)}, {value(two, k)} bytes)")
            total += slope * distance
        numbers[k] = total
    blocks = sorted({layout.blocks(a, b) for a, b in points})
    how = (f"composed from {len(points)} traces of {', '.join(map(str, blocks))} of "
           f"{arch.transformer['num_layers']} blocks" + ("" if checked else " (no third trace checked the lines)"))
    first = traces[base]
    order = list(dict.fromkeys(k[1] for k in first["numbers"] if k[0] == "phase"))
    return Composed(numbers, first["features"], first["preview_shape"], how, order, checked), ""


def features_text(composed: Composed) -> str:
    values = [composed.numbers[k] for k in sorted((k for k in composed.numbers if k[0] == "feature"),
                                                  key=lambda k: k[1])]
    return composed.features.format(*values)


def phase_peak(composed: Composed) -> tuple[str, int, dict[str, int]]:
    """(the phase holding the step's peak, its bytes, bytes per tag there): the first phase (or section) to reach
    the largest, as the counter's own peak is."""
    phases: dict[str, dict[str, int]] = {name: {} for name in composed.order}
    for key, value in composed.numbers.items():
        if key[0] == "phase" and key[2]:
            phases[key[1]][key[2]] = value
    best = max(phases, key=lambda p: sum(phases[p].values()))
    return best.split(":")[0], sum(phases[best].values()), phases[best]
