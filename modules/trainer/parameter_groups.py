"""The optimizer's parameter groups: LoRA+ (the B matrices at `lora.plus_lr_ratio` x the learning rate) and a
fine-tune's per-part learning rates (blocks, embeddings, heads). Without either there is one group, as before, so
backups written before groups existed still resume.

Each group carries a `name` (kept in the optimizer's state dict, so a backup shows which rate is which) and its own
`lr`; the learning-rate schedule scales every group by the same factor. A resume restores each group's rate from
the backup (torch's Optimizer.load_state_dict), so the groups and their rates round-trip."""
import torch

from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.TrainingMethod import TrainingMethod

# diffusers' WanTransformer3DModel: what sits before the blocks (patchify, timestep / text / image embedders) and
# after them (the final modulation table, norm and projection)
EMBEDDING_PREFIXES = ("patch_embedding.", "condition_embedder.")
HEAD_PREFIXES = ("proj_out.", "norm_out.", "scale_shift_table")


def fine_tune_part(name: str) -> str:
    """'blocks', 'embeddings', 'heads' or 'other' for a transformer parameter name (with or without its expert
    prefix, e.g. 'transformer.blocks.0.attn1.to_q.weight')."""
    inner = name.split(".", 1)[1] if name.startswith(("transformer.", "transformer_2.")) else name
    if inner.startswith("blocks."):
        return "blocks"
    if inner.startswith(EMBEDDING_PREFIXES):
        return "embeddings"
    if inner.startswith(HEAD_PREFIXES):
        return "heads"
    return "other"


def is_lora_b(name: str) -> bool:
    """peft's up matrix (lora_B), the zero-initialised factor LoRA+ gives the higher rate."""
    return ".lora_B." in name


def _group(name: str, lr: float, params: list[torch.nn.Parameter]) -> dict:
    return {"name": name, "lr": lr, "params": params}


def parameter_groups(config: TrainConfig, named: list[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """The groups for `named` (the setup's trainable (name, parameter) pairs, in trainable_parameters() order);
    groups that would be empty are left out."""
    lr = config.optimizer.learning_rate
    method = config.training_method
    groups: list[dict] = []
    if method is TrainingMethod.LORA and config.lora.plus_lr_ratio != 1:
        # A matrices, DoRA magnitudes and E2V's fully trained layers keep the rate
        groups = [_group("base", lr, [p for n, p in named if not is_lora_b(n)]),
                  _group("lora_B", lr * config.lora.plus_lr_ratio, [p for n, p in named if is_lora_b(n)])]
    elif method is TrainingMethod.FINE_TUNE:
        fine_tune = config.fine_tune
        rates = {"blocks": fine_tune.blocks_learning_rate, "embeddings": fine_tune.embeddings_learning_rate,
                 "heads": fine_tune.heads_learning_rate}
        if any(rate is not None for rate in rates.values()):
            rates["other"] = None
            groups = [_group(part, lr if rate is None else rate, [p for n, p in named if fine_tune_part(n) == part])
                      for part, rate in rates.items()]
    if not groups:
        return [_group("all", lr, [p for _, p in named])]
    return [g for g in groups if g["params"]]


def group_mismatch(saved: dict, optimizer) -> str | None:
    """Why a backup's optimizer state cannot be loaded into `optimizer` (its groups differ), or None."""
    def names(groups):
        return [str(g.get("name", "all")) for g in groups]
    saved_names, names_now = names(saved["param_groups"]), names(optimizer.param_groups)
    if saved_names == names_now and all(len(a["params"]) == len(b["params"]) for a, b in
                                        zip(saved["param_groups"], optimizer.param_groups)):
        return None
    return (f"the backup's optimizer has the parameter groups {saved_names}, this run has {names_now}: "
            f"lora.plus_lr_ratio and fine_tune.*_learning_rate (set or not) must be as when the backup was written")


def describe_groups(optimizer) -> str | None:
    """'lora_B lr 0.016 (40 tensors), base lr 0.001 (40 tensors)' when there are several groups."""
    if len(optimizer.param_groups) < 2:
        return None
    return ", ".join(f"{g.get('name', i)} lr {g['lr']:g} ({len(g['params'])} tensors)"
                     for i, g in enumerate(optimizer.param_groups))
