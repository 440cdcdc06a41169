"""DeepSpeed's ``deepspeed.utils.groups`` (the module ``dslaunch.utils.groups`` is): this rank's data- and
model-parallel groups.

They come from ``mpu``, the grid of the last engine built (``initialize(mpu=...)``, or a
``pipe.topology.PipelineParallelGrid``), as DeepSpeed's module reads its ``mpu`` global; without
one every rank is a data-parallel peer in the world group (DeepSpeed returns a clone of the world
group; the world itself here: the same ranks, one communicator less), model and tensor sizes are
1 and their ranks 0, and asking for their group raises ``KeyError`` as DeepSpeed does when no such
group was set up. Sequence axes come from the grid's ``runtime.parallel`` groups (a dslaunch grid:
``sequence_parallel_size`` in the config, or the mpu ``UlyssesSPAttentionHF`` returns); without
one its size is 1, the sequence group raises ``KeyError`` and the sequence-data group is the
data-parallel group (DeepSpeed's answers without sequence parallelism). The tensor group is looked
up in the one order of ``runtime.parallel.mpu``.

Expert groups answer by name, as DeepSpeed's: ``_create_expert_and_data_parallel(N)`` splits each
pipeline stage's data ranks into expert groups of ``N`` and expert-data groups (named
``ep_size_<N>``, DeepSpeed's rank layout), kept on the grid's ``ParallelGroups`` (the mpu's, or the
one-axis grid of a job without one: ``grid``); ``_get_expert_*(name)`` read them. Asked without a
name before any split, they answer as DeepSpeed does without expert parallelism: size 1, the expert
group a ``KeyError``, the expert-data group the data-parallel group. Beside an mpu with tensor
slices the splits follow DeepSpeed's two layouts (experts over every rank of a stage, or, through
``_create_expert_data_and_model_parallel``, over each tensor lane's data ranks): ``tensor_experts.py``.
"""

from __future__ import annotations

from typing import Any

from dslaunch.runtime.parallel.groups import ep_size_of
from dslaunch.runtime.parallel.mpu import bwc_tensor_model_parallel_world_size, has_tensor_axis, tensor_axis
from dslaunch.runtime.parallel.tensor_experts import TensorExperts, expert_parallel_ranks

__all__ = [
    "get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank",
    "get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
]

mpu: Any = None
"""The grid of the last engine built with model parallelism (DeepSpeed's ``groups.mpu``); the
engine sets it, None for a data-parallel-only job."""

grid: Any = None
"""The grid of the last engine built (its mpu, or the one-axis ``DataParallelGrid``): where expert
groups live when there is no mpu. Not DeepSpeed's (its expert groups are module dicts)."""


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        from dslaunch.errors import UsageError

        raise UsageError("deepspeed.utils.groups: torch.distributed is not initialized; call "
                         "deepspeed.init_distributed() (or deepspeed.initialize()) first")
    return dist


def _get_data_parallel_group() -> Any:
    dist = _dist()
    group = mpu.get_data_parallel_group() if mpu is not None else None
    return dist.group.WORLD if group is None else group


def _get_data_parallel_world_size() -> int:
    return mpu.get_data_parallel_world_size() if mpu is not None else _dist().get_world_size()


def _get_data_parallel_rank() -> int:
    return mpu.get_data_parallel_rank() if mpu is not None else _dist().get_rank()


def _get_data_parallel_group_ranks() -> list[int]:
    dist = _dist()
    return dist.get_process_group_ranks(_get_data_parallel_group())


def _get_broadcast_src_rank() -> int:
    """The global rank of data-parallel rank 0 of this rank's group (DeepSpeed's broadcast source)."""
    return _get_data_parallel_group_ranks()[0]


def _model(what: str, tensor: bool = False) -> Any:
    """``mpu``'s model-parallel (or tensor-slice) answer; the no-model-parallel answer without one."""
    if mpu is None:
        _dist()
        if what == "group":
            raise KeyError(f"No {'tensor' if tensor else 'model'} parallel group found (no mpu: this job "
                           "runs data parallel only)")
        return 1 if what == "world_size" else 0
    return tensor_axis(mpu, what) if tensor else getattr(mpu, f"get_model_parallel_{what}")()


def get_model_parallel_group() -> Any:
    return _model("group")


def get_model_parallel_world_size() -> int:
    return _model("world_size")


def get_model_parallel_rank() -> int:
    return _model("rank")


def get_tensor_model_parallel_group() -> Any:
    return _model("group", tensor=True)


def get_tensor_model_parallel_world_size() -> int:
    return _model("world_size", tensor=True)


def get_tensor_model_parallel_rank() -> int:
    return _model("rank", tensor=True)


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group (what a batch is
    broadcast from so every slice reads the same); this rank without tensor parallelism."""
    dist = _dist()
    if get_tensor_model_parallel_world_size() == 1:
        return dist.get_rank()
    return min(dist.get_process_group_ranks(get_tensor_model_parallel_group()))


def _axis(role: str) -> tuple[int, int]:
    """(size, my index) of my group of ``role`` on the grid's axes; (1, 0) for a grid without them."""
    grid_groups = getattr(mpu, "groups", None)
    if grid_groups is None or not grid_groups.axes(role):  # (answers without torch.distributed too)
        return 1, 0
    return grid_groups.size(role), grid_groups.rank_in(role)


def _axis_group(role: str, kind: str) -> Any:
    if _axis(role)[0] == 1:
        raise KeyError(f"No {kind} parallel group found (this job has no {kind} parallelism)")
    return mpu.groups.group(role)


def _get_sequence_parallel_world_size() -> int:
    return _axis("sequence")[0]


def _get_sequence_parallel_rank() -> int:
    return _axis("sequence")[1]


def _get_sequence_parallel_group() -> Any:
    return _axis_group("sequence", "sequence")


# ----- expert parallelism, by group name (DeepSpeed's ``ep_size_<N>``) --------------------------
def _home() -> Any:
    """Where the expert groups live (``expert_home``): the mpu's, else the last engine's grid's;
    before any engine, a one-axis grid made here (it is kept: the engine built next takes it).

    Raises:
        UsageError: an mpu without tensor slices that is not a dslaunch grid: its rank layout is unknown.
    """
    global grid
    holder = mpu if mpu is not None else grid
    if holder is None:
        _dist()
        from dslaunch.runtime.parallel.grid import DataParallelGrid

        holder = grid = DataParallelGrid()
    home = expert_home(holder)
    if home is None:
        from dslaunch.errors import UsageError

        raise UsageError(f"expert parallel groups: the mpu {type(holder).__name__} is not a deepspeed "
                         "PipelineParallelGrid, so dslaunch does not know its rank layout; pass "
                         "mpu=PipelineParallelGrid(topology) (or no mpu) to deepspeed.initialize")
    return home


_tensor_home: Any = None
"""The ``TensorExperts`` of the last mpu with tensor slices asked for expert groups (it keeps
their splits, as DeepSpeed's module dicts do); remade for another mpu."""


def expert_home(holder: Any) -> Any:
    """What holds ``holder``'s expert splits (``experts(size, data_before)``, ``expert_sizes()``):
    for an mpu with tensor slices a ``TensorExperts`` (DeepSpeed's layouts beside tensor
    parallelism, ``tensor_experts.py``), else a dslaunch grid's ``ParallelGroups``; None for an
    mpu of unknown layout."""
    global _tensor_home
    if has_tensor_axis(holder, "world_size") and tensor_axis(holder, "world_size") > 1:
        if _tensor_home is None or _tensor_home.mpu is not holder:
            dist = _dist()
            _tensor_home = TensorExperts(holder, dist.get_world_size(), dist.get_rank())
        return _tensor_home
    return getattr(holder, "groups", None)


def data_parallel_grid() -> Any:
    """The one-axis grid for an engine without an mpu: the one expert groups were made on before
    it (same world and rank), else a new one."""
    from dslaunch.runtime.parallel.grid import DataParallelGrid

    fresh = DataParallelGrid()
    if isinstance(grid, DataParallelGrid) and (grid.world_size, grid.global_rank) == (fresh.world_size,
                                                                                       fresh.global_rank):
        return grid
    return fresh


def _ep_size(group_name: str) -> int:
    """The expert-parallel size in a DeepSpeed group name, ``ep_size_<N>``."""
    size = ep_size_of(group_name)
    if size is None:
        raise KeyError(f"expert group name {group_name!r}: DeepSpeed's names are ep_size_<N> (N the expert "
                       "parallel size)")
    return size


def _experts(group_name: str | None) -> Any:
    """The groups of the expert split named ``group_name``; None: the largest split made (None if
    none was)."""
    if group_name is None:  # (answers without torch.distributed too, as before any split)
        holder = mpu if mpu is not None else grid
        home = expert_home(holder) if holder is not None else None
        sizes = home.expert_sizes() if home is not None else []
        return home.experts(max(sizes)) if sizes else None
    home = _home()
    sizes = home.expert_sizes()
    size = _ep_size(group_name)
    if size not in sizes:
        raise KeyError(f"expert parallel group {group_name!r} is not initialized (made: {sorted(sizes)}); "
                       "call deepspeed.utils.groups._create_expert_and_data_parallel first")
    return home.experts(size)


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: int | None = None,
                                     pp_size: int | None = None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False,
                                     folding_spec: Any = None) -> None:
    """Create the expert and expert-data groups for ``expert_parallel_size_`` ranks, named
    ``ep_size_<N>``, once (a second call for a size is a no-op, as in DeepSpeed).

    Within each pipeline stage the data ranks split as DeepSpeed's: by default (E + D) an expert
    group is ``N`` neighbouring data ranks and an expert-data group every ``N``-th (world 4, N 2:
    expert [0, 1], [2, 3]; expert-data [0, 2], [1, 3]); with ``use_data_before_expert_parallel_``
    (D + E) the other way round (expert [0, 2], [1, 3]; expert-data [0, 1], [2, 3]). Beside an mpu
    with tensor slices every rank of a stage counts as a data rank here (DeepSpeed's layout for
    experts that are not tensor-sliced: ``tensor_experts.py``).

    With ``folding_spec`` (AutoEP folded with AutoTP, ``runtime/moe/folding.py``) the split is
    that one (expert groups of neighbouring ranks of the stage), checked against the spec's tables.

    collective: every rank, the same sizes in the same order.

    Raises:
        UsageError: the size does not divide the data-parallel size, an mpu dslaunch cannot place,
            or groups of that name made for another layout than ``folding_spec``'s.
        NotInDslaunchError: ``mp_size`` > 1 without ``folding_spec`` (DeepSpeed's tensor-strided
            orders).
    """
    if (mp_size or 1) > 1 and folding_spec is None:
        from dslaunch.utils.refused import Refusal

        raise Refusal("expert groups ordered over tensor-parallel ranks (mp_size > 1 without folding_spec)",
                      "create them with mp_size=None (experts over every rank of a stage), with folding_spec "
                      "(AutoEP with AutoTP), or with _create_expert_data_and_model_parallel (each tensor lane's data "
                      "ranks split into experts)").error("deepspeed.utils.groups._create_expert_and_data_parallel")
    _make_split(int(expert_parallel_size_), bool(use_data_before_expert_parallel_), sliced=False)
    if folding_spec is not None:
        from dslaunch.errors import UsageError
        from dslaunch.runtime.moe.folding import assert_group_matches_spec

        split = _home().experts(int(expert_parallel_size_))
        try:
            assert_group_matches_spec((split.lists("expert"), split.lists("expert_data")), folding_spec)
        except RuntimeError as err:
            raise UsageError(f"deepspeed.utils.groups._create_expert_and_data_parallel: {err}") from None


def _make_split(size: int, data_before: bool, sliced: bool) -> None:
    home = _home()
    split = home.experts(size, data_before, sliced) if sliced else home.experts(size, data_before)
    split.group("expert_data")  # DeepSpeed's order: expert-data groups, then expert groups
    split.group("expert")


def _create_expert_data_and_model_parallel(expert_parallel_size_: int, mpu: Any,
                                           use_data_before_expert_parallel_: bool = False) -> None:
    """Create the ``ep_size_<N>`` groups for tensor-sliced experts (``MoE(...,
    enable_expert_tensor_parallelism=True)``): each tensor lane's data ranks split into expert
    groups of ``N`` (``tensor_experts.py``); without tensor slices, as
    ``_create_expert_and_data_parallel``. Once per size. collective: every rank.

    Raises:
        UsageError: ``mpu`` is not the job's (``deepspeed.initialize(mpu=...)``), or the sizes do not divide.
    """
    size = bwc_tensor_model_parallel_world_size(mpu)
    if size == 1:
        _create_expert_and_data_parallel(expert_parallel_size_,
                                         use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        return
    if mpu is not globals()["mpu"]:
        from dslaunch.errors import UsageError

        raise UsageError("deepspeed.utils.groups._create_expert_data_and_model_parallel: pass the mpu the engine "
                         "was built with (deepspeed.initialize(mpu=...) sets deepspeed.utils.groups.mpu)")
    _make_split(int(expert_parallel_size_), bool(use_data_before_expert_parallel_), sliced=True)


def _get_expert_model_parallel_world_size() -> int:
    """The tensor slices of each expert: the tensor-parallel size once tensor-sliced expert groups
    were made (``_create_expert_data_and_model_parallel``), else 1 (DeepSpeed's
    ``expert_tensor_parallel_world_size``)."""
    holder = mpu if mpu is not None else grid
    home = expert_home(holder) if holder is not None else None
    return getattr(home, "expert_tensor_size", 1)


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    """``{"ep_size_<N>": my expert group}`` for every size made (a new dict each call)."""
    home = _home()
    return {f"ep_size_{n}": home.experts(n).group("expert") for n in home.expert_sizes()}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    """``{"ep_size_<N>": my expert-data group}`` for every size made (a new dict each call)."""
    home = _home()
    return {f"ep_size_{n}": home.experts(n).group("expert_data") for n in home.expert_sizes()}


def _get_max_expert_size() -> int | None:
    """The largest expert-parallel size made; None before any."""
    sizes = _home().expert_sizes()
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _sequence_data(what: str) -> Any:
    """The grid's data x sequence answer (where gradients average); the data-parallel one without."""
    get = getattr(mpu, f"get_sequence_data_parallel_{what}", None)
    if callable(get):
        _dist()
        return get()
    return {"group": _get_data_parallel_group, "rank": _get_data_parallel_rank,
            "world_size": _get_data_parallel_world_size}[what]()


def _get_sequence_data_parallel_group() -> Any:
    return _sequence_data("group")


def _get_sequence_data_parallel_world_size() -> int:
    return _sequence_data("world_size")


def _get_sequence_data_parallel_rank() -> int:
    return _sequence_data("rank")


def _get_expert_parallel_world_size(group_name: str | None = None) -> int:
    """The ranks of my ``group_name`` expert group (without a name: the grid's expert axis, 1
    without one)."""
    split = _experts(group_name)
    return _axis("expert")[0] if split is None else split.size("expert")


def _get_expert_parallel_rank(group_name: str | None = None) -> int:
    split = _experts(group_name)
    return _axis("expert")[1] if split is None else split.rank_in("expert")


def _get_expert_parallel_group(group_name: str | None = None) -> Any:
    split = _experts(group_name)
    return _axis_group("expert", "expert") if split is None else split.group("expert")


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _experts(group_name).ranks("expert")


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of expert rank 0 of my ``group_name`` expert group."""
    return _get_expert_parallel_group_ranks(group_name)[0]


def _get_expert_data_parallel_world_size(group_name: str | None = None) -> int:
    split = _experts(group_name)
    if split is None:
        return _get_data_parallel_world_size() // _get_expert_parallel_world_size()
    return split.size("expert_data")


def _get_expert_data_parallel_rank(group_name: str | None = None) -> int:
    split = _experts(group_name)
    if split is None:
        return _get_data_parallel_rank() // _get_expert_parallel_world_size()
    return split.rank_in("expert_data")


def _get_expert_data_parallel_group(group_name: str | None = None) -> Any:
    """The data ranks that hold the same experts as mine (without a name and without expert
    parallelism: the data-parallel group)."""
    split = _experts(group_name)
    if split is not None:
        return split.group("expert_data")
    return mpu.groups.group("expert_data") if _axis("expert")[0] > 1 else _get_data_parallel_group()


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _experts(group_name).ranks("expert_data")


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of expert-data rank 0 of my ``group_name`` group (where expert weights are
    broadcast from)."""
    return _get_expert_data_parallel_group_ranks(group_name)[0]


_get_model_parallel_world_size = get_model_parallel_world_size
_get_model_parallel_rank = get_model_parallel_rank
_get_model_parallel_group = get_model_parallel_group
_get_expert_parallel_ranks = expert_parallel_ranks

get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
