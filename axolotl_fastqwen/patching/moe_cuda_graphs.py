"""The sparse MoE blocks of decoder layers that keep their activations, replayed as CUDA graphs.

The 35B-A3B step is bound by its host: ~5,100 kernel launches a step at 24 layers, the GPU 50-90%
busy depending on the machine's CPU (benchmarks/h100/2026-12-07c), and the MoE block is about half of
those launches (router, sort, gather, grouped GEMMs, routed rows, shared expert with its LoRA, each
way). Its shapes are static (the packer's rows have one shape; the expert offsets stay on the device,
`layers/grouped_experts.py`) and it reads nothing from the host, so its forward and its backward can
each be captured once and replayed as one launch, `torch.cuda.make_graphed_callables`' scheme:

- after `WARMUP_CALLS` eager training calls of a block (Triton compiles and autotunes, cuBLAS picks its
  kernels, the experts self-check runs), the block is run once more on a side stream and then captured:
  its forward with autograd's graph into a memory pool shared by the blocks captured in the same forward
  (each block's activations stay allocated there, so a later block reuses only an earlier one's transient
  buffers: on the 35B-A3B those were 3/4 of a block's own pool, measured on an H100), and
  `torch.autograd.grad` of it (the input's and every trainable parameter's gradient) into one pool shared
  by all blocks' backward graphs (backwards run one at a time);
- a training call copies its input into the graph's static input, replays the forward, and returns a
  copy of the static output; its backward copies the output's gradient in, replays the backward, and
  returns the static gradients (autograd accumulates the parameters' gradients as usual).

The activations autograd would hold for the block live in its pool between the two replays: what a
kept layer holds anyway. So only layers that keep their activations are replayed; a layer that
gradient checkpointing recomputes runs the block eagerly (its graph would hold what checkpointing
frees). Everything else that a replay would not see also runs eagerly, and the report counts each
reason: no gradients (eval), a shape or autocast state other than the captured one, the router's
logits being recorded (`output_router_logits`: transformers records them with a forward hook),
forward hooks on the block's modules, tensors not on a CUDA device, torch.compile. The adapters of a
block whose layer keeps its activations cast their own factors, inside the graph, instead of reading
the per-forward copies (`lora_weight_copies.py`): the copies' backward node holds its factors' gradient
accumulators, made on the default stream, and a backward captured on another stream that reaches them
waits on the default stream, which invalidates the capture (cudaErrorStreamCaptureInvalidated on an
H100, benchmarks/h100/2026-12-07d). A capture that fails leaves every block eager, and the report
says in which phase and why. A backward whose block has replayed another forward since raises instead
of training on the wrong activations; weights that moved (`.to()`, a reload) are captured again.

Memory. A pool keeps every segment its captures touched, which the allocator's allocated counters do not
show: what the pools reserve beside their tensors is registered with `memory/graph_pools.py`, and
`fastqwen_checkpointing: auto` adds it to every peak it reads (and gives layers back when a step goes over
its limit, which frees their graphs). So that one forward cannot capture past the device's memory before
`auto` has measured a step, a forward's captures add at most `ROUND_FRACTION` of the device; the rest wait
for the next forward. A capture also needs room now and under `CEILING_FRACTION` of the device.

`fastqwen_moe_cuda_graphs: auto` (the default: one CUDA device, the packer's rows; `integration/settings.py`);
`restore()` gives every block its forward back and drops the graphs.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ..memory import graph_pools
from .instance_forward import replace_forward, restore_forward
from .lora_weight_copies import CASTS_ITSELF

KEY = "_fastqwen_moe_cuda_graphs"  # where `replace_forward` keeps the block's own forward
WARMUP_CALLS = 2  # eager training calls of a block before its capture, with no layer's checkpointing changed
# a block is captured only where the device has this much free beside what its forward holds for its backward
# (measured in the warm-up) times ROOM_FACTOR: its pool's own segments, and the allocator's rounding
ROOM_FACTOR, ROOM_MARGIN = 1.25, 512 * 2**20
# and only while the run's peak so far, what graph pools already hold beside it and that need stay under this
# fraction of the device (without `fastqwen_checkpointing: auto` nothing else watches the pools' growth)
CEILING_FRACTION = 0.95
# the captures of one forward add at most this fraction of the device's memory in pools: `auto` sees the
# pools in the next step's peak (memory/graph_pools.py) and gives layers back where they went over its limit,
# before a forward captures more; one forward capturing every block at once could pass the device's memory
# first (24 blocks held 13.3 GiB on an H100 that `auto` had filled to 70 of its 80 GB)
ROUND_FRACTION = 0.05
NO_ROOM = "no room for its graph"
DEFERRED = "capture deferred: this forward's captures took their share of memory"
TRANSFORMERS_RECORDER = "output_capturing_hook"  # transformers' output recorder (a no-op unless recording)


def _router_logits_recorded() -> bool:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # transformers before 5.x returned them from the block's call: nothing to miss
        return False
    collected = _active_collector.get()
    return bool(collected) and "router_logits" in collected


def _hooked(modules: list[tuple[str, nn.Module]]) -> str | None:
    """A module of the block whose forward hooks a replay would skip (transformers' inactive recorder aside)."""
    for name, module in modules:
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        if any(getattr(h, "__name__", "") != TRANSFORMERS_RECORDER for h in hooks):
            return name or "the block"
    return None


def _recomputed(layer: nn.Module) -> bool:
    """transformers' own test (`GradientCheckpointingLayer`): the layer's forward is recomputed in backward."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training


def _autocast_state(device_type: str = "cuda") -> tuple:
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))


class BlockGraph:
    """One block's captured forward and backward, and the static tensors they read and write."""

    def __init__(self, block: nn.Module, original, x: torch.Tensor, owner: MoeCudaGraphs):
        self.key = _key(x)
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.pointers = _pointers(block)
        self.generation = 0  # forward replays so far: a backward must follow its own forward
        self.pool = None  # the forward graph's memory pool: shared by the blocks captured in the same forward
        self.held = 0  # bytes the block's eager forward leaves allocated for its backward (the warm-up's)
        self.static_x = torch.empty_like(x).copy_(x.detach()).requires_grad_(True)
        enabled, dtype = _autocast_state(x.device.type)
        autocast = torch.autocast(x.device.type, dtype=dtype, enabled=enabled, cache_enabled=False)
        identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)  # not the layer's own hooks
        with autocast, identity:
            self._capture(original, x.device, owner)

    def _capture(self, original, device: torch.device, owner: MoeCudaGraphs) -> None:
        owner.phase = "warm-up on the capture's stream"
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # one eager run on the capture's stream first, as CUDA graphs ask
            before = torch.cuda.memory_allocated(device)
            out = original(self.static_x)
            self.held = torch.cuda.memory_allocated(device) - before  # what the forward leaves for its backward
            self.static_grad_out = torch.zeros_like(out)
            torch.autograd.grad(out, (self.static_x, *self.params), self.static_grad_out, allow_unused=True)
            del out
        torch.cuda.current_stream(device).wait_stream(side)
        owner.check_room(device, int(ROOM_FACTOR * self.held) + ROOM_MARGIN)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.pool = owner.forward_pool()
        owner.phase = "forward capture"
        with torch.cuda.graph(self.forward_graph, pool=self.pool):
            self.static_out = original(self.static_x)
        owner.phase = "backward capture"
        with torch.cuda.graph(self.backward_graph, pool=owner.backward_pool()):
            # retain_graph: the activations the backward graph reads stay allocated in the forward pool (the
            # capture's autograd graph, kept by `static_out`, holds them), so a block captured later into the same
            # pool cannot be given their memory; `release()` drops them
            grads = torch.autograd.grad(self.static_out, (self.static_x, *self.params), self.static_grad_out,
                                        allow_unused=True, retain_graph=True)
        self.static_grad_x, self.static_grads = grads[0], grads[1:]

    def release(self) -> None:
        """Free the graphs and their memory now (an autograd node of a failed step may still refer to this)."""
        for graph in (getattr(self, "forward_graph", None), getattr(self, "backward_graph", None)):
            if graph is not None:
                graph.reset()
        self.forward_graph = self.backward_graph = None
        self.static_x = self.static_out = self.static_grad_out = self.static_grad_x = None
        self.static_grads = ()

    def replay_forward(self) -> None:
        self.forward_graph.replay()

    def replay_backward(self) -> None:
        self.backward_graph.replay()

    def matches(self, block: nn.Module, x: torch.Tensor) -> str | None:
        """Why this graph cannot replay for `x` ("moved": capture again), or None."""
        if _key(x) != self.key:
            return "another shape, dtype or autocast state than the captured one"
        if [id(p) for p in block.parameters() if p.requires_grad] != [id(p) for p in self.params] \
                or _pointers(block) != self.pointers:
            return "moved"
        return None


class NoRoom(RuntimeError):
    """Not enough free device memory for a block's graph: that block runs eagerly, the others are unaffected."""


def _key(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.dtype, x.device, _autocast_state(x.device.type))


def _pointers(block: nn.Module) -> list[int]:
    return [t.data_ptr() for t in (*block.parameters(), *block.buffers())]


class _Replay(torch.autograd.Function):
    """The block as one node: its forward graph replayed, and its backward graph in backward."""

    @staticmethod
    def forward(ctx, graph: BlockGraph, x: torch.Tensor, *params: torch.Tensor):
        graph.static_x.detach().copy_(x)
        graph.replay_forward()
        graph.generation += 1
        ctx.graph, ctx.generation = graph, graph.generation
        return graph.static_out.detach().clone()

    @staticmethod
    def backward(ctx, grad_out):
        graph = ctx.graph
        if graph.static_grad_out is None:
            raise RuntimeError("fastqwen_moe_cuda_graphs: this MoE block's graph was released (unpatch_model, or its "
                               "layer went back to gradient checkpointing) before this backward ran.")
        if graph.generation != ctx.generation:
            raise RuntimeError(
                "fastqwen_moe_cuda_graphs: this MoE block ran another training forward after the one being "
                "backpropagated, so its graph no longer holds that forward's activations. Run backward after "
                "each training forward (as the Trainer does), or set fastqwen_moe_cuda_graphs: false.")
        graph.static_grad_out.copy_(grad_out)
        graph.replay_backward()
        # the static gradients themselves: they are referenced here, so autograd copies or adds them, never keeps them
        return (None, graph.static_grad_x, *graph.static_grads)


@dataclass
class MoeCudaGraphs:
    """The replayed MoE blocks of one model, what ran eagerly and why, and how to give the forwards back."""

    blocks: list[nn.Module] = field(default_factory=list)
    layer_of: dict[int, nn.Module] = field(default_factory=dict, repr=False)
    modules_of: dict[int, list] = field(default_factory=dict, repr=False)  # each block's (name, module)s
    graphs: dict[int, BlockGraph] = field(default_factory=dict, repr=False)
    warm: Counter = field(default_factory=Counter, repr=False)
    replays: int = 0
    captures: int = 0
    eager: Counter = field(default_factory=Counter)
    failed: str | None = None  # a capture that raised: every block runs eagerly from then on
    phase: str = ""  # where the capture under way is (for the report, when one fails)
    kept: tuple = ()  # each layer's gradient checkpointing flag at the last call: a change restarts the warm-up
    no_room: set = field(default_factory=set, repr=False)  # blocks left eager for want of memory (until `kept` changes)
    last_no_room: str | None = None  # the last block left eager for want of memory, and the numbers
    pool_total: int | None = 0  # bytes of the graphs' pools (None: the allocator cannot say), at the last change
    aside: int = 0  # of those, what no allocated tensor holds: what a step's allocated peak does not show
    this_forward: set = field(default_factory=set, repr=False)  # blocks called since the forward began
    added: int = 0  # pool bytes the captures of this forward added
    devices: tuple[str, ...] = ("cuda",)  # where blocks are captured
    graph_class: type = field(default=BlockGraph, repr=False)
    _backward_pool: object = field(default=None, repr=False)
    _forward_pool: object = field(default=None, repr=False)  # the pool of this forward's captures

    @classmethod
    def install(cls, layers: list[nn.Module], block_classes: tuple[type, ...]) -> MoeCudaGraphs:
        self = cls()
        for layer in layers:
            block = getattr(layer, "mlp", None)
            if type(block) not in block_classes or KEY in block.__dict__:
                continue
            self.layer_of[id(block)] = layer
            self.modules_of[id(block)] = list(block.named_modules())
            for _, module in self.modules_of[id(block)]:
                module.__dict__[CASTS_ITSELF] = functools.partial(self.casts_itself, block)
            replace_forward(block, KEY, lambda original, block=block: _GraphedForward(block, original, self))
            self.blocks.append(block)
        if self.blocks:
            graph_pools.register(self.aside_bytes)
        return self

    def why_eager(self, block: nn.Module, x: torch.Tensor) -> str | None:
        """Why this call of `block` runs its own forward, or None (replay, or capture first)."""
        if self.failed is not None:
            return "a capture failed (see the report)"
        if not torch.is_grad_enabled():
            return "no gradients (eval)"
        if x.device.type not in self.devices:
            return "not on a CUDA device"
        if torch.compiler.is_compiling():
            return "under torch.compile"
        if not x.requires_grad:
            return "an input without gradient"
        if _recomputed(self.layer_of[id(block)]):
            self.drop(block)  # auto gave the layer back between steps: free its pool
            return "the layer recomputes its activations (gradient checkpointing)"
        kept = tuple(bool(getattr(m, "gradient_checkpointing", False)) for m in self.layer_of.values())
        if kept != self.kept:  # `fastqwen_checkpointing: auto` is still choosing: capture once it has chosen
            self.kept = kept
            self.warm.clear()
            self.no_room.clear()
        if id(block) in self.no_room:
            return NO_ROOM
        if _router_logits_recorded():
            return "the router's logits are recorded (output_router_logits)"
        hooked = _hooked(self.modules_of[id(block)])
        if hooked is not None:
            return f"forward hooks on {hooked}"
        return None

    def casts_itself(self, block: nn.Module) -> bool:
        """Whether the block's adapters cast their own factors (per-forward copies: `lora_weight_copies.py`):
        while its layer keeps its activations, so that its graph can be captured (and is replayed)."""
        return self.failed is None and not _recomputed(self.layer_of[id(block)])

    def begin_call(self, block: nn.Module) -> None:
        """A block called again starts another forward (its round of captures)."""
        if id(block) in self.this_forward:
            self.this_forward.clear()
            self.added = 0
            self._forward_pool = None
        self.this_forward.add(id(block))

    def device_total(self, device: torch.device) -> int | None:
        return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None

    def deferred(self, device: torch.device) -> bool:
        """Whether this forward's captures have added their share of pool memory already."""
        total = self.device_total(device)
        return total is not None and self.added >= ROUND_FRACTION * total

    def check_room(self, device: torch.device, need: int) -> None:
        """Raise `NoRoom` unless the device has `need` bytes free now and the run's peak so far, the pools'
        unallocated part and `need` stay under `CEILING_FRACTION` of it."""
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's cache
        if free < need:
            raise NoRoom(f"{NO_ROOM} ({need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free)")
        peak, ceiling = torch.cuda.max_memory_allocated(device), CEILING_FRACTION * self.device_total(device)
        if peak + self.aside + need > ceiling:
            raise NoRoom(f"{NO_ROOM} (the peak so far {peak / 2**30:.2f} GiB + pools {self.aside / 2**30:.2f} GiB + "
                         f"{need / 2**30:.2f} GiB needed > {ceiling / 2**30:.2f} GiB)")

    def pool_sizes(self) -> tuple[int, int] | None:
        """(segment bytes, allocated bytes) of every pool the graphs use."""
        pools = list({g.pool: None for g in self.graphs.values() if g.pool is not None})  # each shared pool once
        return graph_pools.pool_sizes([*pools, self._backward_pool] if pools else [])

    def measure(self, free: bool = False) -> None:
        """Read the pools' size after a capture or a release (`free`: hand released pools back first)."""
        if free and torch.cuda.is_available():
            torch.cuda.empty_cache()
        sizes = self.pool_sizes()
        if sizes is None:  # no pool ids in the allocator's snapshot: count what the warm-ups measured, padded
            self.pool_total = None
            self.aside = sum(int(ROOM_FACTOR * g.held) + ROOM_MARGIN for g in self.graphs.values())
        else:
            self.pool_total, allocated = sizes
            self.aside = self.pool_total - allocated

    def captured(self, graph: BlockGraph) -> None:
        """Count a capture, and the pool memory it added to this forward's share."""
        self.captures += 1
        before = self.pool_total
        self.measure()
        if before is None or self.pool_total is None:  # the allocator cannot say: the warm-up's measure, padded
            self.added += int(ROOM_FACTOR * graph.held) + ROOM_MARGIN
        else:
            self.added += max(0, self.pool_total - before)

    def aside_bytes(self) -> int:
        return self.aside

    def forward_pool(self):
        """The memory pool of the forward graphs captured in this forward, as `make_graphed_callables` shares one:
        they replay in the order they were captured and each one's activations stay allocated until it is
        released, so a later block's capture reuses only what an earlier one freed (its transient buffers), never
        its activations. Between forwards the order is not known (a block left eager may be captured later), so
        each forward's captures get a pool of their own."""
        if self._forward_pool is None:
            self._forward_pool = torch.cuda.graph_pool_handle()
        return self._forward_pool

    def backward_pool(self):
        """The memory pool every block's backward graph is captured into (they replay one at a time)."""
        if self._backward_pool is None:
            self._backward_pool = torch.cuda.graph_pool_handle()
        return self._backward_pool

    def drop(self, block: nn.Module) -> None:
        """Free `block`'s graph, if it has one."""
        graph = self.graphs.pop(id(block), None)
        if graph is not None:
            graph.release()
            self._released()

    def _released(self) -> None:
        """After graphs were freed: a pool none of the remaining graphs uses is gone (the allocator refuses
        another capture into it), so later captures get new ones; this forward's captures, a new forward pool."""
        self._forward_pool = None
        if not self.graphs:
            self._backward_pool = None
        self.measure(free=True)

    def restore(self) -> None:
        for block in self.blocks:
            restore_forward(block, KEY)
            for _, module in self.modules_of[id(block)]:
                module.__dict__.pop(CASTS_ITSELF, None)
        self.blocks.clear()
        self.release()
        graph_pools.unregister(self.aside_bytes)

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self._released()

    def to_dict(self) -> dict:
        pools = self.pool_total
        return {"blocks": len(self.blocks), "captured": len(self.graphs), "captures": self.captures,
                "replays": self.replays, "eager_calls": dict(self.eager), "failed": self.failed,
                "last_no_room": self.last_no_room, "pool_bytes": pools, "pool_unallocated_bytes": self.aside,
                "held_bytes": sum(g.held for g in self.graphs.values()), "summary": self.describe(pools)}

    def describe(self, pools: int | None) -> str:
        eager = ", ".join(f"{n} ({why})" for why, n in self.eager.most_common()) or "none"
        state = f"capture failed: {self.failed}; " if self.failed else ""
        if self.last_no_room:
            state += f"last block left eager: {self.last_no_room}; "
        size = f"{pools / 2**30:.2f} GiB" if pools is not None else "an unknown size"
        return (f"{state}{len(self.graphs)} of {len(self.blocks)} sparse blocks captured, {self.replays} replays, "
                f"{size} of graph pools; eager calls: {eager}")


class _GraphedForward:
    """One block's instance forward: its graph replayed where it can be, its own forward otherwise."""

    def __init__(self, block: nn.Module, original, owner: MoeCudaGraphs):
        self.block, self.original, self.owner = block, original, owner

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        owner, key = self.owner, id(self.block)
        owner.begin_call(self.block)
        why = "extra arguments" if args or kwargs else owner.why_eager(self.block, x)
        graph = owner.graphs.get(key)
        if why is None and graph is not None:
            why = graph.matches(self.block, x)
            if why == "moved":  # the weights were replaced: capture again
                owner.drop(self.block)
                graph, why = None, None
        if why is None and graph is None and owner.warm[key] < WARMUP_CALLS:
            owner.warm[key] += 1
            why = "warm-up"
        if why is None and graph is None and owner.deferred(x.device):
            why = DEFERRED
        if why is not None:
            owner.eager[why] += 1
            return self.original(x, *args, **kwargs)
        if graph is None:
            try:
                graph = owner.graphs[key] = owner.graph_class(self.block, self.original, x, owner)
            except NoRoom as error:  # this block stays eager until auto changes what the layers keep
                owner.no_room.add(key)
                owner.eager[NO_ROOM] += 1
                owner.last_no_room = str(error)
                return self.original(x, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any capture failure: eager from now on, named in the report
                owner.failed = f"{owner.phase} of {type(self.block).__name__} raised {type(error).__name__}: " + \
                    str(error).strip().splitlines()[0]
                owner.graphs.clear()  # no more replays; graphs this step replayed live on for their backward
                owner.eager["a capture failed (see the report)"] += 1
                return self.original(x, *args, **kwargs)
            owner.captured(graph)
        owner.replays += 1
        return _Replay.apply(graph, x, *graph.params)

