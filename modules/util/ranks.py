"""Where this process stands in a torch.distributed job, and the few collectives the data loader and trainer share.
Without an initialised process group every function is the single-process case (rank 0 of 1), so callers need
no branch. Objects travel as JSON bytes in uint8 tensors: nothing is unpickled, even between ranks."""
import json

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# distributed.context_parallel: consecutive ranks form one context-parallel group (one clip's tokens split over
# them); the groups are the data-parallel ranks. Set once by distributed.join_process_group.
_context_parallel = 1


# expert parallel (A14B `both`): the first half of the ranks trains one expert, the second half the other; each
# half is data parallel on its own and both halves take the same batches
_expert_parallel = False


def set_context_parallel(size: int) -> None:
    global _context_parallel
    _context_parallel = int(size)


def set_expert_parallel(on: bool) -> None:
    global _expert_parallel
    _expert_parallel = bool(on)


def context_parallel() -> int:
    return _context_parallel if rank_and_world()[1] > 1 else 1


def data_rank_and_size() -> tuple[int, int]:
    """(this process's data-parallel group, the number of groups): what the data is dealt out along. The ranks
    of one context-parallel group share their batches (mesh (dp, cp): rank = dp index x cp + cp index); with expert
    parallel, rank r of each half takes the same share."""
    rank, world = rank_and_world()
    if _expert_parallel and world > 1:
        return rank % (world // 2), world // 2
    size = context_parallel()
    return rank // size, world // size


def in_main_group() -> bool:
    """Whether this rank belongs to rank 0's context-parallel group (rank 0 alone without context parallel): the
    ranks that run a preview together, rank 0 writing it."""
    return rank_and_world()[0] < context_parallel()


def is_main() -> bool:
    return rank_and_world()[0] == 0


def _device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if rank_and_world()[1] > 1:
        dist.barrier()


def all_gather_json(value) -> list:
    """Every rank's `value` (JSON-serialisable), in rank order."""
    if rank_and_world()[1] == 1:
        return [value]
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(_device())
    sizes = [torch.zeros(1, dtype=torch.long, device=payload.device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([payload.numel()], device=payload.device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[:payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [json.loads(bytes(g[:int(s.item())].cpu().tolist()).decode()) for g, s in zip(gathered, sizes)]


def broadcast_json_from(value, source: int):
    """Rank `source`'s `value` on every rank."""
    return all_gather_json(value)[source]


def broadcast_json(value):
    """Rank 0's `value` on every rank (the others' argument is ignored)."""
    return all_gather_json(value if is_main() else None)[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on one (a stop request that reached one process)."""
    if rank_and_world()[1] == 1:
        return bool(flag)
    tensor = torch.tensor([int(bool(flag))], device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def main_decides(flag: bool) -> bool:
    """Rank 0's `flag` on every rank: time-based schedules must fire on all ranks at once or none."""
    if rank_and_world()[1] == 1:
        return bool(flag)
    tensor = torch.tensor([int(bool(flag))], device=_device())
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())
