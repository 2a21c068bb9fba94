"""A decode loop over a static KV cache of fixed rows, refilled as sequences end; every decode step is one
compiled CUDA graph, sampling included.

Who calls it: mortal.workers.rollout.engines.transformers_engine on CUDA, one `StaticDecoder.generate` per
rollout task: all completions of all its prompts (each prompt repeated n times, left-padded to one width P).
Why not transformers' `generate`: per token it runs logits processors, stopping criteria and bookkeeping in
Python and reads a flag back from the GPU, which then waits for Python at every token. Here one decode step
(forward over the static cache, temperature / top-k / top-p, sampling, the token's logprob) is compiled and
recorded as a CUDA graph that Python only replays, reading the GPU back every `sync_every` steps; the
transformers model stays (any architecture whose layers are all full attention).
Continuous batching: the cache has R rows of P + T columns; a row whose sequence ended (EOS or T tokens) is
refilled with the next waiting sequence, each row keeping its own token index, position and mask, so the
step stays one fixed-shape graph. Determinism: sampling is the exponential race on torch's generator, and
which sequence goes into which row depends only on the tokens sampled, so the same sequences, seed, weights
and `max_rows` give the same tokens on one machine. Shapes: a step is captured per (R, P, T, sampling) and
the `kept_shapes` most recent are kept, each costing its KV cache and its graph's memory pool.
Construction installs the packed decode attention and fused projections on the model (values unchanged),
so it is made before the engine loads any weights.
What it must not do: change the model's weight values, mix sequences of different tasks in one call (exact
resume replays a task as one unit), or read the GPU back inside the step (the graph replays blind).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from mortal.workers.oom import BudgetRefusal
from mortal.workers.rollout.engines import decode_attention, fused_projections
from mortal.workers.rollout.engines.prefix_cache import PrefixChain, PromptPrefix

# Decode steps between checks for ended rows. A check waits for the GPU once (a moment of idle GPU while
# Python enqueues the next replays); a row that ended just after one keeps sampling junk until the next.
# A tool loop's turns are short, so a long interval spent most of each turn's steps on junk.
SYNC_EVERY = 8
# A memory budget's share kept for what the row plan does not count: the CUDA graphs' private pools
# (one step's activations), a prefill's activations, the allocator's rounding and fragmentation. The
# floor is for what does not shrink with the budget (cuBLAS's workspaces, torch.compile's autotuning
# buffers): the share of a small budget does not hold them, and the first step ran out of memory.
WORKSPACE_SHARE = 0.15
WORKSPACE_FLOOR = 512 * 2**20
# float32 [rows, vocab] tensors a step holds at once: logits, scaled, probabilities, noise
SAMPLING_COPIES = 4
DEFAULT_MAX_ROWS = 256  # rows of the cache: a task with more sequences refills rows as they end
DEFAULT_KEPT_SHAPES = 2  # captured shapes kept, each with its KV cache
COMPILED_SHAPES = 64  # decode shapes one model may compile (compiled_model says why)
# What torch.compile covers of a decode step's forward: the whole model ("model"), or each decoder layer
# with one graph for all (layer_compiled_model); "auto", the default, is "layer" for a model with a list of
# decoder layers and "model" for one without (resolve_compile_scope). A user picks it
# (spec.generation.compileScope, the same names). Why "layer" by default: it prepares a shape in a fraction
# of the whole model's time and decodes a step nearly as fast (bench/regional_compile.py, docs/benchmarks.md),
# so the whole model pays off only after very many decode steps at few prompt widths.
COMPILE_SCOPES = ("auto", "model", "layer")


def compiled_model(model: Any, backend: Any = "inductor", dynamic: bool | None = False) -> Callable[..., Any]:
    """`model` compiled for decode steps of fixed shapes, up to COMPILED_SHAPES of them. `dynamic`:
    torch.compile's; None (automatic dynamic) compiles a second shape with symbolic sizes that serves every
    later one (on the CPU, 2 graphs for 4 prompt widths against 4), untried on a GPU: StaticDecoder keeps
    False.

    Why the limit is raised: compiled with dynamic=False, every shape (rows, P + T) is a compilation of its
    own, and past dynamo's recompile_limit (8 per code object by default) a new shape is not compiled at
    all: dynamo runs it eagerly, with a warning in the log, and the CUDA graph then records the
    unfused kernels. A run whose prompts fall into more than 8 buckets of 64 tokens (prompts of a few
    to 600 tokens, say) would decode its later shapes that way. The limit is raised only around this
    model's calls (CUDA graph replays do not call it; the captures' warm-ups do)."""
    compiled = torch.compile(model, dynamic=dynamic, backend=backend)

    def forward(**kwargs: Any) -> Any:
        with torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES):
            return compiled(**kwargs)

    return forward


def layer_compiled_model(model: Any, backend: Any = "inductor") -> Callable[..., Any]:
    """`model`'s forward with its decoder layers compiled, one graph serving them all (regional compilation);
    the embedding, final norm and head run eagerly (inside a captured CUDA graph they replay as kernels like
    the rest). Decodes through a StackedRowCache only (it says why).

    Why: compiling the whole model's decode step is most of a rollout's start (docs/benchmarks.md), and the
    layers are one module repeated. Compiled with dynamic=None and the layer
    index unspecialised, layer 0 compiles with everything fixed and a second graph, the index symbolic, serves
    every other layer (docs/benchmarks.md compares it with the whole model). A second decode shape makes
    automatic dynamic shapes compile the sizes symbolic too. The compiled layers stand in the model's layer
    list only during the call: the eager prefill and anything else that calls the model run the plain layers
    (a prefill would otherwise compile each new width)."""
    layers = decoder_layers(model)
    compiled = torch.nn.ModuleList(torch.compile(layer, dynamic=None, backend=backend) for layer in layers)

    def forward(**kwargs: Any) -> Any:
        patch = torch._dynamo.config.patch(
            recompile_limit=COMPILED_SHAPES, allow_unspec_int_on_nn_module=True
        )
        with patch, _layers_replaced(layers, compiled):
            return model(**kwargs)

    return forward


def resolve_compile_scope(model: Any, compile_scope: str) -> str:
    """The scope a decoder compiles for `compile_scope` (one of COMPILE_SCOPES): "auto" is "layer" where the
    model has a list of decoder layers, "model" where it has none; "layer" asked for by name where there is
    none is refused (decoder_layers' ValueError names the way out); "model" is itself."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope {compile_scope!r}: one of {', '.join(COMPILE_SCOPES)}")
    if compile_scope == "model":
        return compile_scope
    try:
        decoder_layers(model)
    except ValueError:
        if compile_scope == "layer":
            raise
        return "model"
    return "layer"


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The repeated decoder layers of a transformers causal LM (`get_decoder().layers`)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no list of decoder layers at get_decoder().layers: "
            f"compile it whole (compile scope 'model')"
        )
    return layers


@contextlib.contextmanager
def _layers_replaced(layers: torch.nn.ModuleList, replacements: torch.nn.ModuleList) -> Iterator[None]:
    originals = list(layers)
    for index, replacement in enumerate(replacements):
        layers[index] = replacement
    try:
        yield
    finally:
        for index, original in enumerate(originals):
            layers[index] = original


def graph_rows(sequences: int, max_rows: int) -> int:
    """Rows of a captured shape for `sequences`: the next power of two, at most max_rows; the rows past
    the sequences idle. Why: each row count is a shape of its own, compiled and captured anew (up to
    torch.compile's recompile limit), and a tool loop's later turns have a different count of live rollouts
    every time. A task of a power of two sequences keeps that many rows."""
    return min(max_rows, 1 << max(0, sequences - 1).bit_length())


class MemoryBudgetTooSmall(torch.OutOfMemoryError, BudgetRefusal):
    """Not even one row's KV cache fits in the rollout's memory budget beside the weights. A torch
    out-of-memory and a BudgetRefusal, so that the worker reports it as one (mortal.workers.oom: exit 4,
    MemoryFits) in its own words, which name the spec field to change."""


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token of one row takes in the KV cache: layers x (K and V) x kv_heads x head_dim x dtype."""
    config = model.config.get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return config.num_hidden_layers * 2 * kv_heads * head_dim * element


def rows_within_budget(
    budget: int,
    weights: int,
    row_bytes: int,
    kept_shapes: int,
    wanted: int,
    workspace_floor: int = WORKSPACE_FLOOR,
) -> int:
    """The most rows (at most `wanted`) whose caches fit in `budget` bytes beside `weights`, with
    WORKSPACE_SHARE of the budget (at least `workspace_floor` bytes) kept aside and room for `kept_shapes`
    such caches at once (a worker keeps that many shapes). Counted from the spec's and the model's sizes only,
    never from the memory in use at the time: the rows are part of what the sampled tokens depend on (module
    docstring), so they must come out the same in a relaunched worker."""
    free = budget - max(int(budget * WORKSPACE_SHARE), workspace_floor) - weights
    return max(0, min(wanted, free // (kept_shapes * row_bytes)))


@dataclass(frozen=True)
class Sampling:
    """What the compiled step bakes in (a change compiles a new graph): temperature, top-k, top-p."""

    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off


def processed_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from: temperature, then top-k, then top-p."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= sampling.top_p  # keeps the first above p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the processed distribution."""
    logprobs = processed_logprobs(logits, sampling)
    race = torch.empty_like(logprobs).exponential_(1.0)
    tokens = (logprobs.exp() / race).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass(frozen=True)
class DecodeStats:
    """How much of one generate's sampling was useful; the engine hands it to the worker's log."""

    rows: int
    sequences: int
    decode_steps: int  # step replays; each samples one token in every row
    refills: int  # sequences prefilled into a row that had held another sequence
    useful_tokens: int  # tokens up to and including each sequence's first EOS (or all T)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the GPU sampled: every row at every step, and each sequence's first token at its prefill."""
        return self.rows * self.decode_steps + self.sequences

    @property
    def useful_fraction(self) -> float:
        return self.useful_tokens / max(self.sampled_tokens, 1)


class RowWrites:
    """Where the layers of one RowCache write: shared by all of them, set by the decoder.

    `columns` [R]: in a decode step, the cache column each row writes its one new K/V to (a tensor of
    the DecodeState, updated in place inside the step). `prefill_rows`: during an eager prefill, the
    rows being filled (their prompts go to columns `prefill_from`..P-1: the columns before hold a shared
    prefix already, prefix_cache); None during decode steps. `appended`: during an eager append (turn_decode),
    where each new token of some rows goes; None otherwise."""

    def __init__(self, columns: torch.Tensor) -> None:
        self.columns = columns
        self.every_row = torch.arange(columns.shape[0], device=columns.device)
        self.prefill_rows: torch.Tensor | None = None
        self.prefill_from = 0
        self.appended: AppendedTokens | None = None


@dataclass(frozen=True)
class AppendedTokens:
    """Tokens appended to rows mid-sequence (an eager forward of [k, F] right-padded tokens): `rows` [k] the
    rows; for each real token (padding is not written), its input's place (`batch`, `position`) and where its
    K/V goes (`write_rows`, `write_columns`). Integer indices: a boolean mask would wait for the GPU."""

    rows: torch.Tensor
    batch: torch.Tensor
    position: torch.Tensor
    write_rows: torch.Tensor
    write_columns: torch.Tensor


class RowScatterLayer(StaticLayer):
    """A StaticLayer whose rows are written at their own columns instead of one shared position.

    Allocated for all R rows up front (never lazily from the first prefill, which fills fewer), so a
    graph can be captured before any prefill. The decode update is one indexed write per tensor:
    fixed shapes, indices read from `writes.columns`, safe to record in a CUDA graph."""

    def __init__(self, max_cache_len: int, rows: int, writes: RowWrites, **kwargs: Any) -> None:
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.rows = rows
        self.writes = writes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate [R, heads, P + T, head_dim] whatever batch the first call brings."""
        heads = key_states.shape[1]
        keys = key_states.new_zeros(self.rows, heads, 0, key_states.shape[-1])
        values = value_states.new_zeros(self.rows, heads, 0, value_states.shape[-1])
        super().lazy_initialization(keys, values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.writes.prefill_rows is not None:
            return self._prefill(self.writes.prefill_rows, key_states, value_states)
        if self.writes.appended is not None:
            return self._append(self.writes.appended, key_states, value_states)
        return self._decode(key_states, value_states)

    def _append(
        self, appended: AppendedTokens, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager: each real appended token's K/V at its own column of its row; returns those rows' K/V."""
        where = (appended.write_rows, slice(None), appended.write_columns)
        what = (appended.batch, slice(None), appended.position)
        self.keys[where] = key_states[what]
        self.values[where] = value_states[what]
        return self.keys.index_select(0, appended.rows), self.values.index_select(0, appended.rows)

    def _prefill(
        self, rows: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager: the prompts of `rows` into their columns from `prefill_from` on; returns those rows' full
        K/V."""
        start = self.writes.prefill_from
        stop = start + key_states.shape[2]
        self.keys[rows, :, start:stop] = key_states
        self.values[rows, :, start:stop] = value_states
        return self.keys.index_select(0, rows), self.values.index_select(0, rows)

    def _decode(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new K/V per row at that row's own column (graph-safe); returns the whole cache.

        Written as index_put_ (keys[row, :, column[row]] = new), which inductor keeps in place; a
        scatter_ may be compiled as a copy of the whole cache per layer and step."""
        self.keys[self.writes.every_row, :, self.writes.columns] = key_states[:, :, 0]
        self.values[self.writes.every_row, :, self.writes.columns] = value_states[:, :, 0]
        return self.keys, self.values


class RowCache(StaticCache):
    """transformers' StaticCache with every layer a RowScatterLayer; allocated at construction."""

    def __init__(self, model: Any, rows: int, max_cache_len: int, writes: RowWrites) -> None:
        super().__init__(config=model.config, max_cache_len=max_cache_len)
        kinds = {type(layer) for layer in self.layers}
        if kinds != {StaticLayer}:
            raise ValueError(
                f"StaticDecoder refills rows of full-attention layers only; this model's cache has "
                f"{sorted(kind.__name__ for kind in kinds)} layers: use the vllm engine, or the "
                f"transformers engine with compiled=False"
            )
        self.layers = [RowScatterLayer(max_cache_len, rows, writes) for _ in self.layers]
        self.writes = writes
        config = model.config.get_text_config(decoder=True)
        param = next(model.parameters())
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.early_initialization(rows, kv_heads, head_dim, param.dtype, param.device)


class StackedRowCache(RowCache):
    """A RowCache whose layers' K/V are views of one [layers, R, heads, P + T, head_dim] tensor each; a decode
    step reaches a layer's through its index into that tensor.

    Why: compiling each decoder layer on its own, one graph for all of them (compile scope "layer"), needs the
    layers to differ only in tensors. transformers' Cache.update picks the layer's object from a list with the
    attention module's `layer_idx`, and dynamo guards on that int and on the object, compiling every layer
    anew; indexing one tensor with the int, left unspecialised, makes it an input of one graph. The eager
    prefill still writes through each layer's object (its views)."""

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The stacked K/V first, then each layer's views of it (one layer's own tensors live at a time, so
        the peak is the cache and one layer, not two caches)."""
        shape = (len(self.layers), batch_size, num_heads, self.layers[0].max_cache_len, head_dim)
        self.all_keys = torch.zeros(shape, dtype=dtype, device=device)
        self.all_values = torch.zeros(shape, dtype=dtype, device=device)
        empty = torch.zeros((batch_size, num_heads, 0, head_dim), dtype=dtype, device=device)
        for index, layer in enumerate(self.layers):
            layer.lazy_initialization(empty, empty)
            layer.keys, layer.values = self.all_keys[index], self.all_values[index]
        torch._dynamo.mark_static_address(self.all_keys)
        torch._dynamo.mark_static_address(self.all_values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.writes.prefill_rows is not None or self.writes.appended is not None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        # The layer is an index of the write, not a view written into: inductor keeps an index_put_ on the
        # stacked tensor (a graph input) in place, but writing into a view of it (all_keys[layer_idx])
        # compiles to a copy of the layer's whole K/V and a copy back, each step (seen in the post-grad
        # graph).
        layer = torch.full_like(self.writes.every_row, layer_idx)
        self.all_keys[layer, self.writes.every_row, :, self.writes.columns] = key_states[:, :, 0]
        self.all_values[layer, self.writes.every_row, :, self.writes.columns] = value_states[:, :, 0]
        return self.all_keys[layer_idx], self.all_values[layer_idx]


class DecodeState:
    """The tensors one decode step reads and writes in place, one entry per row: a captured graph
    replays over exactly these, and Python refills rows by writing into them between replays."""

    def __init__(
        self,
        rows: int,
        prompt_len: int,
        max_tokens: int,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        length = prompt_len + max_tokens
        self.rows, self.prompt_len, self.max_tokens = rows, prompt_len, max_tokens
        self.last_token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        # index of the token each row samples next
        self.t = torch.zeros(rows, dtype=torch.long, device=device)
        self.columns = torch.zeros(rows, dtype=torch.long, device=device)  # the cache column each row writes
        self.mask = torch.zeros(rows, 1, 1, length, dtype=dtype, device=device)  # additive
        self.ended = torch.zeros(rows, dtype=torch.bool, device=device)  # sampled a stop id
        self.stop = torch.zeros(vocab, dtype=torch.bool, device=device)  # per token id: ends a sequence
        # Column T is where a row that reached max_tokens writes (never read).
        self.tokens = torch.zeros(rows, max_tokens + 1, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, max_tokens + 1, dtype=torch.float32, device=device)


class Stepper(Protocol):
    """What a decode step is: its state and its step function. StaticDecoder.prepare's default (stepper
    None) is this module's single-turn step over a DecodeState; turn_decode.TURNS is the other, for
    conversations across turns. A prepared shape is kept per stepper `kind` too."""

    kind: str

    def new_state(
        self,
        rows: int,
        prompt_len: int,
        max_tokens: int,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> DecodeState: ...

    def step_function(
        self,
        forward: Callable[..., Any],
        cache: RowCache,
        state: Any,
        sampling: Sampling,
        compiled: bool = False,
    ) -> Callable[[], None]:
        """The step over `state`; `compiled`: the decoder compiles (its forward is compiled, and the step may
        compile what it does around it)."""
        ...


@dataclass
class PreparedShape:
    """Everything kept for one (rows, prompt width, max_tokens, sampling)."""

    cache: RowCache
    state: DecodeState
    advance: Callable[[], None]  # replays (or runs) one decode step over `state`
    # what a stepper's caller builds for this shape and keeps with it (turn_decode: its append graphs)
    extras: dict[str, Any] = field(default_factory=dict)


class RowSchedule:
    """Which sequence each row holds and when Python must look at the GPU again; pure bookkeeping.

    Sequences are handed out in order. Every step advances every live row's token index t by one
    until T, so t is known here without a read-back; only "sampled an EOS" needs one."""

    def __init__(self, rows: int, sequences: int, max_tokens: int, sync_every: int = SYNC_EVERY) -> None:
        self.max_tokens = max_tokens
        self.sync_every = sync_every
        self.sequences = sequences
        self.held: list[int | None] = [None] * rows  # the sequence whose tokens are in the row's buffer
        self.live = [False] * rows
        self.t = [0] * rows
        self.next_waiting = 0
        self.refills = 0

    def assign(self, rows: list[int]) -> list[tuple[int, int, int | None]]:
        """Give the next waiting sequences to these free rows, in order: (row, sequence, sequence it held)."""
        given = []
        for row in rows:
            if self.next_waiting == self.sequences:
                break
            given.append((row, self.next_waiting, self.held[row]))
            self.refills += self.held[row] is not None
            self.held[row], self.live[row], self.t[row] = self.next_waiting, True, 1
            self.next_waiting += 1
        return given

    def advance(self, steps: int) -> None:
        self.t = [
            min(t + steps, self.max_tokens) if live else t for t, live in zip(self.t, self.live, strict=True)
        ]

    def steps_to_check(self, steps_done: int) -> int:
        """Steps until the next check: the next multiple of sync_every, or sooner if a live row reaches T."""
        to_sync = self.sync_every - steps_done % self.sync_every
        to_limit = min(
            (self.max_tokens - t for t, live in zip(self.t, self.live, strict=True) if live), default=to_sync
        )
        return min(to_sync, to_limit)

    def finish(self, ended: list[bool]) -> list[int]:
        """Mark live rows that sampled an EOS or reached T as finished; returns them, in row order."""
        done = [
            row
            for row, live in enumerate(self.live)
            if live and (ended[row] or self.t[row] >= self.max_tokens)
        ]
        for row in done:
            self.live[row] = False
        return done

    @property
    def any_live(self) -> bool:
        return any(self.live)


class StaticDecoder:
    """Continuous-batched sampling for one model on one device; a step is captured per shape and sampling.

    `compile` False runs the same step eagerly, without a graph (CPU tests of the loop itself).
    `max_rows`: the most rows decoded at once (more sequences wait and refill ended rows).
    `kept_shapes`: how many prepared shapes (cache + graph) are kept; the least recently used goes.
    `sync_every`: decode steps between read-backs that look for ended rows.
    `memory_budget`: bytes this decoder's model and kept caches must fit in (the rollout's share of its GPU);
    a shape then gets no more rows than rows_within_budget allows, and MemoryBudgetTooSmall when not one fits.
    `compile_scope`: one of COMPILE_SCOPES, what torch.compile covers when `compile` is on (the attribute
    holds what "auto" resolved to); `dynamic` applies to
    the "model" scope (the "layer" scope compiles with automatic dynamic shapes, layer_compiled_model says
    why). After each generate, `last_stats` says how much of the sampling was useful; `preparations`
    counts the shapes prepared (captured, on CUDA) since construction."""

    def __init__(
        self,
        model: Any,
        compile: bool = True,
        max_rows: int = DEFAULT_MAX_ROWS,
        kept_shapes: int = DEFAULT_KEPT_SHAPES,
        sync_every: int = SYNC_EVERY,
        memory_budget: int | None = None,
        dynamic: bool | None = False,
        compile_scope: str = "auto",
    ) -> None:
        if min(max_rows, kept_shapes, sync_every) < 1:
            raise ValueError(
                f"max_rows ({max_rows}), kept_shapes ({kept_shapes}) and sync_every ({sync_every}) "
                f"must be at least 1"
            )
        # refused here, before anything is installed
        compile_scope = resolve_compile_scope(model, compile_scope)
        decode_attention.install(model)  # one query token per row reads each key/value head once
        fused_projections.fuse(model)  # q/k/v and gate/up as one matmul each (before any weight load)
        self.model = model
        self.compile = compile
        self.max_rows = max_rows
        self.kept_shapes = kept_shapes
        self.sync_every = sync_every
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.memory_budget = memory_budget
        # torch.compile's, for the decode step (compiled_model); bench/decode_shapes.py compares
        self.dynamic = dynamic
        self.compile_scope = compile_scope
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        self._shapes: OrderedDict[tuple[int, int, int, Sampling, str], PreparedShape] = OrderedDict()
        self.preparations = 0
        self.last_stats: DecodeStats | None = None
        # the last call's shared prompt prefix, in pieces, for the next call (prefix_cache); forget_weights()
        self.prefixes = PrefixChain()

    @torch.no_grad()
    def prepare(
        self,
        sequences: int,
        prompt_len: int,
        max_tokens: int,
        sampling: Sampling,
        min_rows: int = 0,
        stepper: Stepper | None = None,
    ) -> PreparedShape:
        """The kept cache, state and step for `sequences` prompts of this width (and at least rows for
        `min_rows`), or new ones (evicting the least recently used; `preparations` counts them). Callable
        before generate() to time the compile apart. Without autograd whoever calls it: compiled with grad
        enabled, the step would trace a backward through the decode-attention op, which has none.
        `stepper`: what a step does (None: the single-turn step of this module)."""
        rows = self.rows_for(max(sequences, min_rows), prompt_len + max_tokens)
        key = (rows, prompt_len, max_tokens, sampling, stepper.kind if stepper else "single-turn")
        if key in self._shapes:
            self._shapes.move_to_end(key)
            return self._shapes[key]
        while len(self._shapes) >= self.kept_shapes:
            self._shapes.popitem(last=False)
        if stepper is None:
            state = DecodeState(rows, prompt_len, max_tokens, self.vocab, self.dtype, self.device)
        else:
            state = stepper.new_state(rows, prompt_len, max_tokens, self.vocab, self.dtype, self.device)
        cache_class = StackedRowCache if self.compile_scope == "layer" else RowCache
        cache = cache_class(self.model, rows, prompt_len + max_tokens, RowWrites(state.columns))
        if stepper is None:
            step = self._step_function(cache, state, sampling)
        else:
            step = stepper.step_function(self._forward(), cache, state, sampling, compiled=self.compile)
        prepared = PreparedShape(cache, state, self._capture(cache, step) if self.compile else step)
        self._shapes[key] = prepared
        self.preparations += 1
        return prepared

    def rows_for(self, sequences: int, length: int) -> int:
        """Rows for `sequences` of `length` (prompt + max tokens) columns: all of them up to max_rows (with
        captured graphs, rounded up as graph_rows says), and no more than the memory budget holds (each row:
        its KV cache and its share of the sampling tensors)."""
        rows = graph_rows(sequences, self.max_rows) if self.compile else min(sequences, self.max_rows)
        if self.memory_budget is None:
            return rows
        row_bytes = length * kv_bytes_per_token(self.model) + SAMPLING_COPIES * 4 * self.vocab
        fit = rows_within_budget(self.memory_budget, self.weight_bytes, row_bytes, self.kept_shapes, rows)
        if fit < 1:
            raise MemoryBudgetTooSmall(
                f"the rollout's memory budget ({self.memory_budget / 2**30:.2f} GiB, "
                f"rollout.gpuMemoryUtilization of the GPU) holds {self.weight_bytes / 2**30:.2f} GiB of "
                f"weights and {WORKSPACE_SHARE:.0%} workspace (at least {WORKSPACE_FLOOR / 2**20:.0f} MiB), "
                f"and no room for {self.kept_shapes} KV caches of one row of {length} tokens "
                f"({row_bytes / 2**20:.1f} MiB each): raise rollout.gpuMemoryUtilization, or lower "
                "generation.maxTokens"
            )
        return fit

    def _step_function(self, cache: RowCache, state: DecodeState, sampling: Sampling) -> Callable[[], None]:
        """One decode step over every row: fixed-shape tensor ops only (it is recorded as a CUDA graph)."""
        forward = self._forward()
        last_column = state.prompt_len - 1
        max_tokens = state.max_tokens

        def step() -> None:
            # 1. each row writes the token it sampled last at its own column (P + t - 1) and unmasks it
            torch.add(state.t, last_column, out=state.columns)
            state.mask.scatter_(3, state.columns.view(-1, 1, 1, 1), 0.0)
            # 2. one token per row through the model, sampled
            logits = forward(
                input_ids=state.last_token,
                position_ids=state.positions,
                attention_mask=state.mask,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            token, logprob = sample(logits, sampling)
            # 3. recorded at each row's t (a row past max_tokens writes the spare column T)
            out = state.t.clamp(max=max_tokens)[:, None]
            state.tokens.scatter_(1, out, token[:, None])
            state.logprobs.scatter_(1, out, logprob[:, None])
            state.ended.logical_or_(state.stop[token])
            # 4. rows below max_tokens move on; a row at T stays there
            live = (state.t < max_tokens).long()
            state.last_token.copy_(token[:, None])
            state.positions.add_(live[:, None])
            state.t.add_(live)

        return step

    def _forward(self) -> Callable[..., Any]:
        """The model's forward a decode step calls: compiled over the compile scope, or the model itself."""
        if not self.compile:
            return self.model
        if self.compile_scope == "layer":
            return layer_compiled_model(self.model)
        return compiled_model(self.model, dynamic=self.dynamic)

    def _capture(self, cache: RowCache, step: Callable[[], None]) -> Callable[[], None]:
        """Warm up (compiles) on a side stream, then record one step as a CUDA graph; returns its replay.

        The warm-ups write the cache and state; generate() resets both before every call."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        # The warm-ups sample too: in a forked RNG, so the caller's seeded stream is the same whether or not
        # this call captured (else a worker's first batch of a shape would differ from a warm worker's).
        with torch.random.fork_rng(devices=[self.device]), torch.cuda.stream(side):
            for _ in range(2):
                cache.reset()
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_tokens: int,
        sampling: Sampling,
        eos_ids: list[int],
        min_rows: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S, T'], logprobs [S, T']) for S left-padded prompts, in their order; T' is the longest
        completion's length. What follows a sequence's first EOS is junk the caller cuts (cut_at_eos).
        `min_rows`: decode in the shape of that many sequences (the rows past these S idle)."""
        sequences, prompt_len = input_ids.shape
        shape = self.prepare(sequences, prompt_len, max_tokens, sampling, min_rows)
        rows = shape.state.rows
        shape.cache.reset()
        shape.state.stop.zero_()
        shape.state.stop[[i for i in eos_ids if 0 <= i < self.vocab]] = True
        prompts = self.prompts(input_ids, attention_mask, max_tokens, eos_ids)
        outputs = _Outputs(sequences, max_tokens, self.device)
        schedule = RowSchedule(rows, sequences, max_tokens, self.sync_every)
        steps = self._decode(shape, prompts, schedule, sampling, outputs)
        outputs.take(shape.state, [(row, seq) for row, seq in enumerate(schedule.held) if seq is not None])
        lengths = outputs.lengths(shape.state.stop)
        self.last_stats = DecodeStats(
            rows=rows,
            sequences=sequences,
            decode_steps=steps,
            refills=schedule.refills,
            useful_tokens=sum(lengths),
        )
        longest = max(lengths)
        return outputs.tokens[:, :longest].clone(), outputs.logprobs[:, :longest].clone()

    def _decode(
        self,
        shape: PreparedShape,
        prompts: Prompts,
        schedule: RowSchedule,
        sampling: Sampling,
        outputs: _Outputs,
    ) -> int:
        """The loop of the module docstring; returns the decode steps run."""
        # 1. fill every row
        self._fill(shape, prompts, schedule.assign(list(range(len(schedule.held)))), sampling, outputs)
        steps = 0
        while True:
            # 2. replay until the next check
            steps_run = schedule.steps_to_check(steps)
            for _ in range(steps_run):
                shape.advance()
            schedule.advance(steps_run)
            steps += steps_run
            # 3. check: which live rows have finished (one read-back)
            finished = schedule.finish(shape.state.ended.tolist())
            # 4. refill them with waiting sequences
            self._fill(shape, prompts, schedule.assign(finished), sampling, outputs)
            # 5. stop once no row is live
            if not schedule.any_live:
                return steps

    def _fill(
        self,
        shape: PreparedShape,
        prompts: Prompts,
        given: list[tuple[int, int, int | None]],
        sampling: Sampling,
        outputs: _Outputs,
    ) -> None:
        """Eager: copy out what the rows held, prefill their new sequences' prompts into them, sample each
        one's first token and reset the rows' state (t = 1, position, mask, ended)."""
        if not given:
            return
        state = shape.state
        outputs.take(state, [(row, old) for row, _, old in given if old is not None])
        rows = torch.tensor([row for row, _, _ in given], device=self.device)
        logits = self.prefill(shape, prompts, rows, [seq for _, seq, _ in given])
        token, logprob = sample(logits, sampling)
        state.tokens[rows, 0], state.logprobs[rows, 0] = token, logprob
        state.last_token[rows] = token[:, None]
        state.t[rows] = 1
        state.ended[rows] = state.stop[token]

    def forget_weights(self) -> None:
        """The model's weights changed: nothing computed with the old ones is reused (the prefix chain)."""
        self.prefixes.clear()

    def prompts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_tokens: int, eos_ids: list[int]
    ) -> Prompts:
        """One call's left-padded prompts on this device, with the prefix they all share computed once
        (prefix_cache, in pieces that end after each of `eos_ids`, kept ones reused; None where none is
        worth it)."""
        lengths = attention_mask.sum(dim=-1).tolist()
        ids, real = input_ids.to(self.device), attention_mask.to(self.device, torch.bool)
        prefix = PromptPrefix.of(self.model, ids, lengths, self.prefixes, eos_ids)
        return Prompts(ids, real, max_tokens, self.dtype, lengths, prefix)

    def prefill(
        self, shape: PreparedShape, prompts: Prompts, rows: torch.Tensor, chosen: list[int]
    ) -> torch.Tensor:
        """Eager: the prompts `chosen` into `rows` (columns 0..P-1 of their cache; with a shared prefix, its
        K/V copied in and only the columns after it computed), each row's position and decode mask set for
        its first decode step; returns each row's last-position logits [k, vocab]."""
        index = torch.tensor(chosen, device=self.device)
        ids, real = prompts.ids[index], prompts.real[index]
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        start = prompts.first_computed_column(chosen)
        if prompts.prefix is not None:
            pads = [prompts.width - prompts.lengths[c] for c in chosen]
            prompts.prefix.write(shape.cache.layers, rows, pads)
        shape.cache.writes.prefill_rows, shape.cache.writes.prefill_from = rows, start
        try:
            # logits_to_keep=1: the last position's logits only, not [rows, P, vocab] (GBs at 256 rows)
            logits = self.model(
                input_ids=ids[:, start:],
                position_ids=positions[:, start:],
                attention_mask=prompts.prefill_mask(real, start),
                past_key_values=shape.cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        finally:
            shape.cache.writes.prefill_rows, shape.cache.writes.prefill_from = None, 0
        shape.state.positions[rows] = positions[:, -1:] + 1
        shape.state.mask[rows] = prompts.decode_mask(real)
        return logits


class _Outputs:
    """Every sequence's tokens and logprobs [S, T], in the task's order, copied out of the rows."""

    def __init__(self, sequences: int, max_tokens: int, device: torch.device) -> None:
        self.tokens = torch.zeros(sequences, max_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(sequences, max_tokens, dtype=torch.float32, device=device)

    def take(self, state: DecodeState, held: list[tuple[int, int]]) -> None:
        """What rows hold, into their sequences' places: (row, sequence) pairs; a GPU copy, no read-back."""
        if not held:
            return
        rows = torch.tensor([row for row, _ in held], device=self.tokens.device)
        sequences = torch.tensor([seq for _, seq in held], device=self.tokens.device)
        self.tokens.index_copy_(0, sequences, state.tokens[rows, : state.max_tokens])
        self.logprobs.index_copy_(0, sequences, state.logprobs[rows, : state.max_tokens])

    def lengths(self, stop: torch.Tensor) -> list[int]:
        """Each sequence's length up to and including its first stop id (T if none); one read-back."""
        stops = stop[self.tokens]
        first = stops.long().argmax(-1) + 1
        return torch.where(stops.any(-1), first, self.tokens.shape[1]).tolist()


class Prompts:
    """The task's left-padded prompts and the masks a row needs when one of them is prefilled into it.

    `lengths`: each prompt's real tokens (on the host); `prefix`: the K/V of the prefix they all share, or
    None (StaticDecoder.prompts builds both)."""

    def __init__(
        self,
        ids: torch.Tensor,
        real: torch.Tensor,
        max_tokens: int,
        dtype: torch.dtype,
        lengths: list[int],
        prefix: PromptPrefix | None = None,
    ) -> None:
        self.ids, self.real = ids, real
        self.lengths, self.prefix = lengths, prefix
        self.width = ids.shape[1]
        self.length = self.width + max_tokens
        self.dtype = dtype
        self.blocked = torch.finfo(dtype).min
        device = ids.device
        self.causal = torch.ones(self.width, self.length, dtype=torch.bool, device=device).tril()
        self.pad_rows_see_themselves = torch.eye(self.width, self.length, dtype=torch.bool, device=device)

    def _visible(self, real: torch.Tensor) -> torch.Tensor:
        """[k, P + T]: a row's real prompt columns (padding and not yet written columns are hidden)."""
        visible = torch.zeros(real.shape[0], self.length, dtype=torch.bool, device=real.device)
        visible[:, : self.width] = real
        return visible

    def first_computed_column(self, chosen: list[int]) -> int:
        """The first prompt column a prefill of `chosen` computes: 0, or with a shared prefix the first column
        after it in the longest of them (the others' columns there are padding or prefix, computed again)."""
        if self.prefix is None:
            return 0
        return self.width - max(self.lengths[c] for c in chosen) + self.prefix.length

    def prefill_mask(self, real: torch.Tensor, start: int = 0) -> torch.Tensor:
        """[k, 1, P - start, P + T] additive, the queries of columns start..P-1: causal over real tokens; a
        padding query sees itself (no empty row)."""
        allowed = (
            self._visible(real)[:, None, None, :] & self.causal[None, None, start:]
        ) | self.pad_rows_see_themselves[start:]
        return self._additive(allowed)

    def decode_mask(self, real: torch.Tensor) -> torch.Tensor:
        """[k, 1, 1, P + T] additive: the prompt's real columns; each step unmasks the column it writes."""
        return self._additive(self._visible(real)[:, None, None, :])

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """An additive mask in the model's dtype (works for eager and SDPA attention alike)."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(
            ~allowed, self.blocked
        )
