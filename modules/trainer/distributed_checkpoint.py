"""Backups of a multi-process run, in the single-process backup format (backup_io: safetensors and JSON only),
so a backup resumes on any world size.

Why not torch.distributed.checkpoint's own files: its default writer stores `.metadata` as a pickle, and the
project writes and reads no pickles. Its safetensors writer (HuggingFaceStorageWriter) stores tensors only, not
the optimizer's nested state. So the full state dicts are gathered on rank 0 with
`torch.distributed.checkpoint.state_dict` (`full_state_dict=True, cpu_offload=True`) and written by rank 0 through
backup_io; a sharded (FSDP2) resume loads them on rank 0 and broadcasts (`broadcast_from_rank0=True`). The price:
rank 0 needs CPU memory for the trained weights and their optimizer state while a backup is written.

What a backup adds over a single-process one: `ranks.json` ({"world_size", "batch_size"}: the global batch is
their product) and `rng.ranks`, every rank's RNG state. Resuming keeps the global batch, so the data order goes on
where it stopped: with another world size the per-rank batch becomes global batch / world size.

Adapters over a sharded base gather only what trains (each adapter tensor and its optimizer state, one at a time):
the frozen base is never gathered, and the backup is the one a DDP or single-process run writes.
"""
import json
from pathlib import Path

import torch

from modules.dataLoader.pipeline.PipelineModule import derive_seed
from modules.trainer.backup_io import restore_rng_state, rng_state
from modules.util.ranks import all_gather_json, any_rank, data_rank_and_size, rank_and_world

RANKS_FILE = "ranks.json"


def backup_layout(folder: Path) -> dict:
    """{"world_size", "batch_size"} of the run that wrote the backup (a single-process backup: 1 x its batch);
    "world_size" counts the data-parallel groups (context-parallel ranks share a batch)."""
    if (folder / RANKS_FILE).is_file():
        return json.loads((folder / RANKS_FILE).read_text())
    return {"world_size": 1, "batch_size": json.loads((folder / "config.json").read_text())["batch_size"]}


def keep_global_batch(trainer) -> None:
    """Before the data order is set up for a resume: makes this run's global batch the backup's, changing the
    per-rank batch when the world size changed (2 ranks x 1 -> 1 rank x 2), so the same batches follow."""
    folder = trainer.resume_choice.folder if trainer.resume_choice is not None else None  # what _resume takes
    if folder is None:
        return
    layout = backup_layout(folder)
    saved = layout["world_size"] * layout["batch_size"]
    _, world = data_rank_and_size()
    if trainer.config.batch_size * world == saved:
        return
    if saved % world:
        raise ValueError(f"{folder} was written with a global batch of {saved} ({layout['world_size']} "
                         f"processes x batch_size {layout['batch_size']}); {world} processes cannot share it evenly: "
                         f"resume on a world size that divides {saved}")
    trainer.config.batch_size = saved // world
    trainer.data.rebuild()
    if trainer.parallel.is_main:
        print(f"resuming a backup of {layout['world_size']} processes x batch_size {layout['batch_size']} on {world}: "
              f"batch_size is {trainer.config.batch_size} per process to keep the global batch of {saved}", flush=True)


def _names_and_parameters(trainer) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(expert, name inside it, parameter) of a sharded fine-tune, in trainable_parameters() order."""
    return [(expert, name, p) for expert, transformer in trainer.parallel.sharded.items()
            for name, p in transformer.named_parameters() if p.requires_grad]


def gather_backup_state(trainer) -> tuple[dict, dict, dict, dict]:
    """(trainable tensors, optimizer state, RNG states, layout) for a backup; every rank must call it. Rank 0's
    values are complete; the others' are partial and not written."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    rank, world = rank_and_world()
    layout = {"world_size": data_rank_and_size()[1], "batch_size": trainer.config.batch_size}
    rng = rng_state()
    if world > 1:
        mine = {"torch": torch.get_rng_state().tolist()}
        if trainer.device.type == "cuda":
            mine["cuda"] = torch.cuda.get_rng_state(trainer.device).tolist()
        rng["ranks"] = [{k: torch.tensor(v, dtype=torch.uint8) for k, v in state.items()}
                        for state in all_gather_json(mine)]
    if trainer.parallel.base_sharded:
        return _gather_adapters(trainer), _gather_optimizer(trainer), rng, layout
    if trainer.parallel.experts is not None:
        # expert parallel: each expert's adapter and optimizer state from its own ranks first, then as DDP
        trainer.parallel.experts.gather(trainer.setup, trainer.optimizer, trainer.device)
    if not trainer.parallel.sharded:
        # DDP keeps the trainable weights and optimizer state equal on every rank: rank 0's are the whole state
        return trainer.setup.trainable_state_dict(), trainer.optimizer.state_dict(), rng, layout
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    trainable, names = {}, _names_and_parameters(trainer)
    for expert, transformer in trainer.parallel.sharded.items():
        full = get_model_state_dict(transformer, options=options)  # whole on rank 0, empty elsewhere
        trainable.update({f"{expert}.{n}": full[n] for e, n, _ in names if e == expert and rank == 0})
    if not any_rank(bool(trainer.optimizer.state)):
        # no optimizer step yet (Ctrl-C at step 0): no state to write. torch's get_optimizer_state_dict would make
        # one with a zero-gradient step (step=1 in every Adam state) in this live optimizer and in the backup, so
        # the run, and a resume from the backup, would differ from one that never stopped
        return trainable, (_empty_optimizer_state(trainer.optimizer, names) if rank == 0 else {}), rng, layout
    # (single expert for fine-tunes) optimizer keys by parameter name -> by position, as optimizer.state_dict()
    expert = next(iter(trainer.parallel.sharded))
    full_optimizer = get_optimizer_state_dict(trainer.parallel.sharded[expert], trainer.optimizer, options=options)
    if rank != 0:
        return {}, {}, rng, layout
    position = {n: i for i, (_, n, _) in enumerate(names)}
    optimizer_state = {"state": {position[n]: s for n, s in full_optimizer["state"].items()},
                       "param_groups": [{**g, "params": [position[n] for n in g["params"]]}
                                        for g in full_optimizer["param_groups"]]}
    return trainable, optimizer_state, rng, layout


def _gather_adapters(trainer) -> dict:
    return {f"{expert}.{name}": tensor for expert, tensors in trainer.parallel.full_trainable().items()
            for name, tensor in tensors.items()}


def _gather_optimizer(trainer) -> dict:
    """optimizer.state_dict() with every sharded state tensor whole (rank 0; every rank must call it)."""
    from torch.distributed.tensor import DTensor

    state = trainer.optimizer.state_dict()  # the same parameter positions and keys on every rank
    whole = {position: {key: value.full_tensor().cpu() if isinstance(value, DTensor) else value
                        for key, value in entries.items()}
             for position, entries in state["state"].items()}
    return {"state": whole, "param_groups": state["param_groups"]} if trainer.parallel.is_main else {}


def _restore_adapters(trainer, state: dict) -> None:
    """Every rank read the same backup: each cuts its own shards out of the whole tensors, no communication."""
    parameters = dict(trainer.setup.named_trainable_parameters())
    with torch.no_grad():
        for name, parameter in parameters.items():
            _own_part(parameter, state["trainable"][name], copy_into=True)
    positions = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    saved = state["optimizer"]
    trainer.optimizer.load_state_dict({
        "state": {position: {key: _own_part(positions[int(position)], value) for key, value in entries.items()}
                  for position, entries in saved["state"].items()},
        "param_groups": saved["param_groups"]})


def _own_part(parameter: torch.nn.Parameter, whole: torch.Tensor, copy_into: bool = False):
    """This rank's shard of `whole`, laid out as `parameter` is (a plain tensor, such as Adam's step, as it is)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(parameter, DTensor) or whole.shape != parameter.shape:
        if copy_into:
            parameter.copy_(whole)
        return whole
    part = distribute_tensor(whole.to(parameter.device), parameter.device_mesh, parameter.placements,
                             src_data_rank=None)
    if copy_into:
        parameter.to_local().copy_(part.to_local())
    return part


def _empty_optimizer_state(optimizer: torch.optim.Optimizer, names: list) -> dict:
    """optimizer.state_dict()'s form for an optimizer that has not stepped: its groups, parameters by position."""
    position = {id(p): i for i, (_, _, p) in enumerate(names)}
    return {"state": {}, "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                                           "params": [position[id(p)] for p in group["params"]]}
                                          for group in optimizer.param_groups]}


def restore_backup_state(trainer, state: dict) -> None:
    """Loads a backup's trainable weights, optimizer state and this rank's RNG (every rank calls it)."""
    if trainer.parallel.base_sharded:
        _restore_adapters(trainer, state)
    elif trainer.parallel.sharded:
        _restore_sharded(trainer, state)
    else:
        trainer.setup.load_trainable_state_dict(state["trainable"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    rank, world = rank_and_world()
    ranks = state["rng"].get("ranks")
    if ranks is not None and rank < len(ranks):
        torch.set_rng_state(ranks[rank]["torch"])
        if "cuda" in ranks[rank] and trainer.device.type == "cuda":
            torch.cuda.set_rng_state(ranks[rank]["cuda"], trainer.device)
    elif rank == 0:
        restore_rng_state(state["rng"])
    else:
        # a rank the backup did not have (1 -> 2): its own stream, reproducible from the seed and the step
        torch.manual_seed(derive_seed(trainer.config.seed, state["progress"].global_step, rank, "rank_rng") >> 1)


def _restore_sharded(trainer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    main = trainer.parallel.is_main
    names = _names_and_parameters(trainer)
    for expert, transformer in trainer.parallel.sharded.items():
        weights = {n: state["trainable"][f"{expert}.{n}"] for e, n, _ in names if e == expert} if main else {}
        set_model_state_dict(transformer, weights, options=options)
    saved = state["optimizer"]
    if not saved["state"]:
        # a backup from before the first optimizer step (every rank reads the same backup): the new optimizer is
        # already in that state; torch's set_optimizer_state_dict would first step it with zero gradients (step=1)
        return
    full_optimizer = {}
    if main:
        full_optimizer = {"state": {names[int(i)][1]: s for i, s in saved["state"].items()},
                          "param_groups": [{**g, "params": [names[int(i)][1] for i in g["params"]]}
                                           for g in saved["param_groups"]]}
    expert = next(iter(trainer.parallel.sharded))
    set_optimizer_state_dict(trainer.parallel.sharded[expert], trainer.optimizer, full_optimizer, options=options)
