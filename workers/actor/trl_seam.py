"""The one module that depends on how TRL's GRPOTrainer works inside, beyond its documented API.

Called by mortal.workers.actor (loop, training, checkpoint). tests/workers/actor/test_trl_seam.py pins every
assumption below and fails loudly when a TRL upgrade breaks one; the tested range is TESTED_TRL (pinned in
pyproject's `train` extra too). It must not know about the store, the queue or the spec.

What mortal relies on (TRL 1.16):
1. `rollout_func(prompts, trainer)` is called once per optimizer step with the whole generation batch (each
   prompt repeated num_generations times), which TRL shuffles and trains in steps_per_generation
   micro-batches. Its dict holds prompt_ids / completion_ids / logprobs, one entry per completion; every
   other key reaches the reward functions as a keyword argument.
2. Reward functions are called as f(prompts=, completions=, completion_ids=, **columns), named by their
   `__name__` in metrics (`rewards/<name>/mean`); None becomes NaN.
3. TRL's importance correction of samples from other weights (vLLM's) is gated by a flag read after
   __init__ only where it is harmless here; `enable_sampling_correction` sets it after construction.
4. `Trainer._save_checkpoint` writes model or adapter, optimizer, scheduler, RNG states and
   trainer_state.json, and `train(resume_from_checkpoint=dir)` restores them (public API).
5. The advantages TRL trained a step on are the newest entries of `trainer._logs["advantages"]`, in
   rollout_func's order.
6. The loss never holds [tokens x vocab] logits: GRPOTrainer patches the model's forward with TRL's fused,
   chunked LM head and calls it with `fused_lm_head=True`. `check_fused_lm_head` checks the patch, and
   `warm_up_training` calls the patched forward as TRL does.
7. A rollout_func key "env_mask" (1 = a model token, 0 = a tool's) becomes TRL's tool_mask when the trainer
   has no tools of its own: the loss mask is completion_mask x env_mask.
8. The Trainer calls `compute_loss` once per micro-batch after `_prepare_inputs` (rollout_func, rewards,
   advantages) returned: the first call of a step ends TRL's preparation and starts the update, which
   `time_loss_start` stamps.
9. With prompts that are not chat messages, `_generate` decodes rollout_func's "completion_ids" with
   `processing_class.batch_decode`; `reuse_rollout_texts` hands it the rollouts' texts instead of a second
   decode, the largest piece of TRL's host work before the loss.
10. The loss's forward gets prompts padded on the left beside completions padded on the right (one unbroken
   run of ones per row in attention_mask), with input_ids, attention_mask, labels and fused_lm_head=True
   only: the premise of mortal.workers.actor.padding_shift.
11. With `torch_compile` the Trainer's TorchDynamoPlugin reads ACCELERATE_DYNAMO_USE_DYNAMIC from the
   environment; `compile_settings` sets it, so the model compiles once for any batch width rather than
   again at the first new width.
12. The same plugin reads ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION: accelerate then compiles each decoder
   layer on a copy of the model whose methods it binds to the copy (so TRL's fused forward and
   padding_shift's run the compiled layers).
13. The fused head scores every position of the batch (prompts and padding too) where the chunked kernel has
   no Triton (the CPU), and only the labelled ones where it has (CUDA), as `trl.trainer.utils._use_triton`
   of the device says; `score_labelled_positions_only` makes a model's fused calls score only those on the
   CPU too: the same log-probabilities, gradients within float32 sums in another order.
14. `vllm_importance_sampling_correction` is read by `_generate_and_score_completions` (a forward pass for the
   current policy's log-probabilities, the importance ratio and its metrics) and by `_compute_loss` (the loss
   times `inputs["importance_sampling_ratio"]`, read after the one `_get_per_token_logps_and_entropies` call
   of the policy), besides __init__; `correct_in_loss` turns it off for the first and on around the second.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import inspect
import os
import shutil
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

from packaging.specifiers import SpecifierSet

if TYPE_CHECKING:
    import torch
    from trl import GRPOTrainer

TESTED_TRL = ">=1.16,<1.17"
REWARDS_KEY = "mortal_rewards"
VERSION_KEY = "mortal_weight_version"
ENV_MASK_KEY = "env_mask"  # TRL's name (assumption 7)
REQUIRED_ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")
HandTexts = Callable[[list[list[int]], list[str]], None]  # reuse_rollout_texts' hand(completion_ids, texts)


class TrlSeamError(RuntimeError):
    """TRL behaved differently from what this module relies on (an untested TRL version?)."""


def trl_version() -> str:
    return importlib.metadata.version("trl")


def trl_version_tested() -> bool:
    return trl_version() in SpecifierSet(TESTED_TRL)


class PrecomputedReward:
    """A TRL reward function that returns the score a rollout worker already computed.

    TRL keeps its own weighting, advantage computation and per-reward logging; the scores arrive in
    the REWARDS_KEY column (one {name: score} dict per completion) that rollout_func returns.
    """

    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float | None]:
        scores = kwargs.get(REWARDS_KEY)
        if scores is None or len(scores) != len(completions):
            raise TrlSeamError(
                f"reward {self.__name__!r} got no precomputed scores for {len(completions)} completions: "
                f"TRL no longer passes rollout_func's extra keys to reward functions"
            )
        return [row.get(self.__name__) for row in scores]


def check_rollout_call(prompts: list[Any], batch_size: int) -> None:
    """rollout_func must receive the whole generation batch (prompts repeated G times), once a step."""
    if len(prompts) != batch_size:
        raise TrlSeamError(
            f"rollout_func received {len(prompts)} prompts, expected {batch_size} (prompts x num_generations)"
        )


def rollout_output(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    logprobs: list[list[float]],
    rewards: list[dict[str, float | None]],
    weight_versions: list[int],
    env_masks: list[list[int]] | None = None,
) -> dict[str, Any]:
    """What rollout_func returns: one entry per completion in every list (`env_masks`: assumption 7)."""
    n = len(completion_ids)
    if not (len(prompt_ids) == len(logprobs) == len(rewards) == len(weight_versions) == n):
        raise ValueError("rollout output lists differ in length")
    if env_masks is not None and (
        len(env_masks) != n or any(len(m) != len(c) for m, c in zip(env_masks, completion_ids, strict=True))
    ):
        raise ValueError("env_masks must hold one mask entry per completion token")
    return ({ENV_MASK_KEY: env_masks} if env_masks is not None else {}) | {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": logprobs,
        REWARDS_KEY: rewards,
        VERSION_KEY: weight_versions,
    }


def step_advantages(trainer: GRPOTrainer, n: int) -> list[float] | None:
    """The advantages of the step just trained, one per completion in rollout_func's order; None when
    TRL kept fewer than `n` (an untested TRL: test_trl_seam pins that 1.16 keeps them)."""
    logs = getattr(trainer, "_logs", None)
    kept = logs.get("advantages") if isinstance(logs, dict) else None
    if kept is None or len(kept) < n:
        return None
    return [float(a) for a in list(kept)[-n:]]


class _NoEngine:
    """Stands where TRL keeps its vLLM engine: rollout workers load weights themselves."""

    def sync_weights(self) -> None:
        return None


def enable_sampling_correction(
    trainer: GRPOTrainer, mode: str = "token_truncate", clip_max: float = 2.0
) -> None:
    """Correct the loss for samples drawn from other weights (staleness > 0), with TRL's own code.

    token_truncate: per-token ratio exp(logp_current - logp_sampling), clipped at `clip_max` (TIS). TRL
    takes logp_current from a forward pass of its own while it prepares the batch; `correct_in_loss` then
    moves the ratio into the loss, from the loss's own forward.
    """
    for attr in ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode"):
        if not hasattr(trainer, attr):
            raise TrlSeamError(f"GRPOTrainer has no attribute {attr!r}: the sampling correction moved")
    trainer.use_vllm = True
    trainer.vllm_generation = _NoEngine()
    trainer._last_loaded_step = trainer.state.global_step
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_max = clip_max
    trainer.vllm_importance_sampling_clip_min = None


# what correct_in_loss reports, in the order of its metric vectors
_RATIO_METRICS = (
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)


class _RatioInLoss:
    """correct_in_loss's state: the micro-batch whose loss is running, and metric vectors not yet read."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer = trainer
        self.inputs: dict[str, Any] | None = None
        self.pending: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}

    def weigh(self, per_token_logps: torch.Tensor) -> None:
        """The ratio of the running micro-batch from its policy log-probabilities, as TRL computes it while
        preparing (token_truncate), put where the loss reads it; its metrics kept on the device."""
        import torch

        inputs, trainer = self.inputs, self.trainer
        self.inputs = None  # the loss's first call is the policy's; nothing after it is weighed
        if inputs is None or inputs.get("sampling_per_token_logps") is None:
            return
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        current, sampling = per_token_logps.detach(), inputs["sampling_per_token_logps"]
        difference = torch.nan_to_num((current - sampling) * mask, nan=0.0)
        ratio = torch.exp(difference).clamp(max=trainer.vllm_importance_sampling_clip_max)
        inputs["importance_sampling_ratio"] = ratio
        seen = mask.bool()
        delta = (current - sampling).abs()
        scored = seen & ~torch.isnan(delta)
        inf = torch.tensor(float("inf"), device=ratio.device)
        metrics = torch.stack(
            [
                torch.where(seen, ratio, inf).amin(),
                (ratio * seen).sum() / seen.sum().clamp(min=1),
                torch.where(seen, ratio, -inf).amax(),
                torch.where(scored, delta, 0.0).sum() / scored.sum().clamp(min=1),
                torch.where(scored, delta, 0.0).amax(),
            ]
        )
        self.pending["train" if trainer.model.training else "eval"].append(metrics.float())

    def flush(self) -> None:
        """Metric vectors read (one copy a log, not a sync a micro-batch), gathered over ranks as TRL's
        are."""
        import torch

        for mode, vectors in self.pending.items():
            if not vectors:
                continue
            gathered = self.trainer.accelerator.gather(torch.stack(vectors)).view(-1, len(_RATIO_METRICS))
            for name, column in zip(_RATIO_METRICS, gathered.T.tolist(), strict=True):
                finite = [v for v in column if v not in (float("inf"), float("-inf"))] or [0.0]
                combine = min if name.endswith("/min") else max if name.endswith("/max") else statistics.fmean
                self.trainer._metrics[mode][name].append(combine(finite))
            vectors.clear()


def correct_in_loss(trainer: GRPOTrainer) -> None:
    """After enable_sampling_correction: compute the importance ratio in the loss, from the log-probabilities
    the loss's forward computes anyway, instead of a forward pass of its own while TRL prepares the batch
    (assumption 14). Why it is the same ratio: with one iteration per generation batch (num_iterations 1)
    and the optimizer stepping after the batch's last micro-batch, the weights at every micro-batch's loss
    are those TRL's preparation saw; TRL takes those log-probabilities as the loss's old ones too. Why: that
    forward is a quarter of the actor's GPU work, and with maxStaleness the actor shares the GPU with
    generation. The metrics TRL logged while preparing are logged from the loss (one read a log).
    Instance attributes only, so other trainers of the process are untouched."""
    args = trainer.args
    if trainer.num_iterations != 1 or args.gradient_accumulation_steps % args.steps_per_generation:
        raise TrlSeamError(
            "correct_in_loss needs one iteration per generation batch, trained within one optimizer step "
            f"(num_iterations {trainer.num_iterations}, steps_per_generation {args.steps_per_generation}, "
            f"gradient_accumulation_steps {args.gradient_accumulation_steps})"
        )
    mode = trainer.vllm_importance_sampling_mode
    if mode != "token_truncate":
        raise TrlSeamError(f"correct_in_loss computes token_truncate, not {mode}")
    state = _RatioInLoss(trainer)
    compute_loss, log = trainer.compute_loss, trainer.log
    log_probs = trainer._get_per_token_logps_and_entropies
    trainer.vllm_importance_sampling_correction = False  # TRL's preparation: no forward, no ratio

    def loss(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        state.inputs = inputs
        trainer.vllm_importance_sampling_correction = True  # the loss multiplies by the ratio
        try:
            return compute_loss(model, inputs, *args, **kwargs)
        finally:
            trainer.vllm_importance_sampling_correction = False
            state.inputs = None

    def policy_log_probs(*args: Any, **kwargs: Any) -> Any:
        out = log_probs(*args, **kwargs)
        state.weigh(out[0])
        return out

    def logged(*args: Any, **kwargs: Any) -> Any:
        state.flush()
        return log(*args, **kwargs)

    trainer.compute_loss = loss
    trainer._get_per_token_logps_and_entropies = policy_log_probs
    trainer.log = logged


def patched_model(trainer: GRPOTrainer) -> torch.nn.Module:
    """The model whose forward TRL patched with its fused LM head: under peft, the model peft wraps."""
    model = trainer.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_fused_lm_head(trainer: GRPOTrainer) -> None:
    """The trainer's loss goes through TRL's fused LM head, never full logits (assumption 6)."""
    base = patched_model(trainer)
    forward = vars(base).get("forward")
    if forward is None or "fused_lm_head" not in inspect.signature(forward, follow_wrapped=False).parameters:
        raise TrlSeamError(
            f"{type(base).__name__}.forward is not TRL's fused LM head (add_fused_lm_head): the loss would "
            "hold the [tokens x vocab] logits"
        )


_LABELLED_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("labelled_only", default=False)


def _install_labelled_only_switch() -> None:
    """Once per process: TRL's fused head asks `_use_triton(device)` whether to score only the labelled
    positions (assumption 13); the answer becomes yes inside `score_labelled_positions_only`'s calls and
    stays TRL's everywhere else (other threads and trainers included)."""
    import trl.trainer.utils as trl_utils

    trl_use_triton = trl_utils._use_triton  # AttributeError: TRL renamed it, see assumption 13
    if getattr(trl_use_triton, "labelled_only_switch", False):
        return

    def use_triton(device: torch.device) -> bool:
        return _LABELLED_ONLY.get() or trl_use_triton(device)

    use_triton.labelled_only_switch = True  # type: ignore[attr-defined]
    trl_utils._use_triton = use_triton


def score_labelled_positions_only(model: torch.nn.Module) -> bool:
    """Make the fused-head calls of `model` (TRL's patched model: patched_model) score only the labelled
    positions, as TRL does on CUDA (assumption 13): on the CPU it would score the prompts and the padding
    too, most of a step's tokens. Returns whether it did (not where the forward is not TRL's method). As
    padding_shift.install's, the new forward is a method that calls TRL's function on whatever module it is
    bound to (accelerate's regional compilation binds it to a copy), and keeps `fused_lm_head`."""
    if not isinstance(model.forward, MethodType) or getattr(model.forward, "labelled_only", False):
        return False
    _install_labelled_only_switch()
    trl_forward = model.forward.__func__

    def forward(self: Any, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return trl_forward(self, *args, **kwargs)
        token = _LABELLED_ONLY.set(True)
        try:
            return trl_forward(self, *args, fused_lm_head=True, **kwargs)
        finally:
            _LABELLED_ONLY.reset(token)

    forward.labelled_only = True  # type: ignore[attr-defined]
    model.forward = MethodType(forward, model)
    return True


DYNAMIC_SHAPES_ENV = "ACCELERATE_DYNAMO_USE_DYNAMIC"
REGIONAL_ENV = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"


@contextlib.contextmanager
def compile_settings(compiling: bool, scope: str) -> Iterator[None]:
    """Around GRPOTrainer(...), when it will compile (torch_compile): dynamic shapes from the first step, so
    the model compiles once for every batch width (assumption 11), and with scope "layer" accelerate's
    regional compilation, each repeated layer compiled on its own from one layer's code (assumption 12). A
    value the environment already holds wins (0 for dynamic shapes: static ones, every new width compiled
    again); the variables are put back after."""
    wanted = []
    if compiling:
        wanted = [DYNAMIC_SHAPES_ENV, REGIONAL_ENV] if scope == "layer" else [DYNAMIC_SHAPES_ENV]
    added = [name for name in wanted if name not in os.environ]
    os.environ.update(dict.fromkeys(added, "1"))
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def time_loss_start(trainer: GRPOTrainer, stamp: Callable[[], None]) -> None:
    """Call `stamp()` as each micro-batch's loss begins (assumption 8), then TRL's compute_loss; an instance
    attribute, so other trainers of the process are untouched."""
    compute_loss = trainer.compute_loss

    def stamped(*args: Any, **kwargs: Any) -> Any:
        stamp()
        return compute_loss(*args, **kwargs)

    trainer.compute_loss = stamped


def reuse_rollout_texts(trainer: GRPOTrainer) -> HandTexts:
    """Make the trainer's tokenizer answer batch_decode(ids, skip_special_tokens=True) for the completion_ids
    list of one rollout_func output with texts handed beforehand (assumption 9); any other call decodes.
    Returns `hand(completion_ids, texts)`, to call with the exact list rollout_func returns. A hand-over is
    used at most once, so a later decode of the same list decodes for real."""
    tokenizer = trainer.processing_class
    decode = tokenizer.batch_decode
    handed: dict[str, Any] = {}

    def batch_decode(sequences: Any, *args: Any, **kwargs: Any) -> Any:
        if handed and sequences is handed["ids"] and not args and kwargs == {"skip_special_tokens": True}:
            texts = handed["texts"]
            handed.clear()
            return list(texts)
        return decode(sequences, *args, **kwargs)

    def hand(completion_ids: list[list[int]], texts: list[str]) -> None:
        if len(texts) != len(completion_ids):
            raise ValueError(f"{len(texts)} texts handed for {len(completion_ids)} completions")
        handed.update(ids=completion_ids, texts=texts)

    tokenizer.batch_decode = batch_decode
    return hand


# 63 scored positions: not a multiple of 16, as most real batches' counts are (Triton specializes on it)
WARM_UP_TOKENS = 64


def warm_up_training(trainer: GRPOTrainer, tokens: int = WARM_UP_TOKENS) -> None:
    """One forward and backward of the trained model through TRL's fused LM head (assumption 6) on `tokens`
    placeholder tokens, nothing kept: the first real step then finds the head's Triton kernels compiled, the
    GPU's matmul handles made and the gradients' memory in the allocator's pool (costs a first step pays
    many times over the steps after it). Gradients are dropped (None, as before a first step) and
    the RNG put back, so the steps that follow are those a run without it takes. Autograd is on for it
    whatever the caller's mode (rollout_func's callers may generate without it)."""
    import torch

    model = trainer.model
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(tokens, device=device).remainder(vocab).unsqueeze(0)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
        output = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True)
        output.loss.backward()
    model.zero_grad(set_to_none=True)


def set_learning_rate(trainer: GRPOTrainer, learning_rate: float) -> bool:
    """Make `learning_rate` the base rate of the trainer's optimizer and scheduler, keeping the schedule's
    position (a group at lr = base x f(step) goes to learning_rate x f(step)); True if anything changed.

    A resume loads the optimizer's and scheduler's state, base rates included, from the checkpoint,
    so without this a run resumed under a changed spec.algorithm.learningRate (a fork, an apply) would
    train on at the checkpoint's rate. Call it after the Trainer loaded them (on_train_begin).
    """
    scheduler, optimizer = trainer.lr_scheduler, trainer.optimizer
    bases = list(
        getattr(scheduler, "base_lrs", None) or [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    )
    if all(base == learning_rate for base in bases):
        return False
    for i, group in enumerate(optimizer.param_groups):
        base = bases[i]
        group["lr"] = group["lr"] / base * learning_rate if base else learning_rate
        group["initial_lr"] = learning_rate
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return True


def save_checkpoint(trainer: GRPOTrainer, dest: Path) -> None:
    """Write the trainer's complete state (model or adapter, optimizer, scheduler, RNG, trainer state)
    into the existing empty directory `dest`, using the Trainer's own checkpoint writer."""
    step = trainer.state.global_step
    saved_output_dir = trainer.args.output_dir
    trainer.args.output_dir = str(dest)
    try:
        trainer._save_checkpoint(trainer.model, trial=None)
    finally:
        trainer.args.output_dir = saved_output_dir
    written = dest / f"checkpoint-{step}"
    if not (written / "trainer_state.json").is_file():
        raise TrlSeamError(f"Trainer._save_checkpoint did not write {written}/trainer_state.json")
    for entry in os.listdir(written):
        os.rename(written / entry, dest / entry)
    os.rmdir(written)
    for extra in ("README.md",):  # TRL's model card, written next to the checkpoint folder
        if (dest / extra).is_file():
            os.remove(dest / extra)
    if (dest / "runs").is_dir():
        shutil.rmtree(dest / "runs")


def checkpoint_files(dest: Path) -> list[str]:
    """The files a checkpoint must hold to resume exactly (used to verify one before trusting it)."""
    model = (
        "adapter_model.safetensors" if (dest / "adapter_model.safetensors").exists() else "model.safetensors"
    )
    return [model, "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]
