"""One pipeline stage of a transformers model, loaded through pploader, and a pipeline forward.

Called on every rank of a PP job (TP = EP = 1: transformers modules are not TP-sharded)::

    stage = build_stage(model_dir, topology)        # meta skeleton, only this stage's layers real
    logits = pipeline_forward(stage, input_ids, comm)  # last stage gets logits, others None

How a stage is built (all model knowledge comes from transformers itself):

- the full model is instantiated on the ``meta`` device (no memory);
- decoder layers outside ``[start_layer, end_layer)`` become :class:`PassThrough` modules: no
  parameters, same return convention, attribute reads fall through to the meta original (the
  model's own code reads ``layer.attention_type`` and the like);
- off the first stage the input embedding becomes a zero source (the received hidden states are
  injected at the first owned layer, so whatever the model does between embedding and layers —
  Falcon-H1's ``embedding_multiplier`` for one — happens on the first stage only); the text
  model's other parameter-holding children registered before the layers (position embeddings,
  embedding norms: first-stage tensors) become zero-filled placeholders there, whose output is
  likewise replaced; off the last stage the head and the text model's parameter-holding
  children registered after the layers (final norm) become ``nn.Identity``;
- pploader plans and reads only this stage's tensors; transformers' own checkpoint conversion
  (renames, per-expert tensors stacked into fused 3-D params) places them, exactly as
  ``from_pretrained`` would; non-persistent buffers (``rotary_emb.inv_freq``, Falcon-H1's
  ``mup_vector``) are recomputed by the model's own initialiser, never loaded;
- strict by default: a parameter left on ``meta`` or a read tensor the model does not take is a
  :class:`~pploader.errors.PlanError` naming the tensors.

Position ids, masks and rotary tables are recomputed on every stage from ``input_ids``; only
hidden states travel between stages, through :class:`~pploader.dist.comm.Comm` ``send``/``recv``.
"""
from __future__ import annotations

import ast
import inspect
import os
import textwrap
import threading
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..planning.checkpoint import open_checkpoint
from ..errors import ConfigError, PlanError, PPLoaderError, TopologyError
from ..families.hf_meta import forward_order
from ..planning.partition import StageWindow
from ..planning.plan import Partition, RankPlan, make_windows, plan_rank
from ..io.read import Reader, ReadStats
from ..planning.spec import ModelSpec, load_spec
from ..planning.topology import Topology

if typing.TYPE_CHECKING:  # pragma: no cover
    from ..dist.comm import Comm

__all__ = ["PassThrough", "HFStage", "stage_skeleton", "load_stage_weights", "build_stage",
           "pipeline_forward"]


class PassThrough(nn.Module):
    """Stands in for a decoder layer another stage owns: returns its hidden states unchanged.

    Holds no parameters. ``tuple_len`` > 0 mimics layers returning ``(hidden, extra, ...)``.
    Attributes it lacks are read from the (meta, unregistered) original layer.
    """

    def __init__(self, original: nn.Module, layer_idx: int) -> None:
        super().__init__()
        self.__dict__["_original"] = original  # not a submodule: no params, no state_dict
        self.layer_idx = layer_idx
        self.tuple_len = _tuple_len(type(original).forward)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None:
                raise
            return getattr(original, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return (hidden,) + (None,) * (self.tuple_len - 1) if self.tuple_len else hidden


def _tuple_len(forward: Callable) -> int:
    """How many elements a layer's forward returns (0: a bare tensor).

    Read from the ``return`` statements of its source (annotations are not reliable: some
    layers are annotated ``tuple[...]`` and return a tensor); the annotation is the fallback
    when there is no source. A wrong guess cannot corrupt results: a pass-through's output is
    either replaced at the first owned layer or never computed (see ``HFStage.forward``).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        tree = None
    if tree is not None and tree.body and isinstance(tree.body[0], ast.FunctionDef):
        fn = tree.body[0]
        tuples: dict[str, int] = {}
        lens = []
        for node in _own_nodes(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                for tgt in node.targets:
                    if isinstance(tgt, ast.Name):
                        tuples[tgt.id] = len(node.value.elts)
            if isinstance(node, ast.Return) and node.value is not None:
                if isinstance(node.value, ast.Tuple):
                    lens.append(len(node.value.elts))
                elif isinstance(node.value, ast.Name):
                    lens.append(tuples.get(node.value.id, 0))
        if lens:
            return max(lens)
    ann = inspect.signature(forward).return_annotation
    if isinstance(ann, str):
        text = ann.replace(" ", "")
        if not text.startswith(("tuple[", "Tuple[")):
            return 0
        depth, parts = 0, 1
        for ch in text[text.index("[") + 1:-1]:
            depth += ch == "["
            depth -= ch == "]"
            parts += ch == "," and depth == 0
        return parts
    return len(typing.get_args(ann)) if typing.get_origin(ann) is tuple else 0


def _own_nodes(fn: ast.FunctionDef) -> list[ast.AST]:
    """The AST nodes of ``fn``'s body in source order, not descending into nested functions."""
    out: list[ast.AST] = []
    stack: list[ast.AST] = list(reversed(fn.body))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return out


class _StageDone(Exception):
    """Raised by the hook on a non-last stage's last layer: the rest of the model is not run."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stage done")
        self.hidden = hidden


class _ZeroEmbedding(nn.Module):
    """Input embedding of a non-first stage: zeros of the right shape (replaced at the first
    owned layer by the hidden states received from the previous stage)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size, self.dtype = hidden_size, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.hidden_size, dtype=self.dtype,
                           device=input_ids.device)


@dataclass(frozen=True)
class _Anatomy:
    """Where the stage-relevant modules of a transformers model live (dotted paths)."""

    text_model: str      # owns the input embedding and the decoder layers
    embed: str
    layers: str
    head: Optional[str]
    last_globals: tuple[str, ...]   # parameter-holding children of the text model after the layers
    first_globals: tuple[str, ...]  # parameter-holding modules beside the text model (vision)
    pre_layers: tuple[str, ...] = ()  # children of the text model between embedding and layers
                                      # (position embeddings, embedding norms): first stage


def _anatomy(model: nn.Module, num_layers: int) -> _Anatomy:
    names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, module in model.named_modules():
        children = dict(module.named_children())
        if not any(c is embed for c in children.values()):
            continue
        lists = [n for n, c in children.items()
                 if isinstance(c, nn.ModuleList) and len(c) == num_layers]
        if len(lists) != 1:
            break
        prefix = path + "." if path else ""
        order = list(children)
        at = order.index(lists[0])
        others = [n for n in order if children[n] is not embed and n != lists[0]
                  and _has_params(children[n])]
        called = forward_order(model, prefix + lists[0])  # run before / after the layers

        def stage(n: str) -> str:
            return called.get(prefix + n, "first" if order.index(n) < at else "last")
        last = tuple(prefix + n for n in others if stage(n) == "last")
        pre = tuple(prefix + n for n in others if stage(n) == "first")
        head_path = names.get(id(head)) if head is not None else None
        return _Anatomy(path, names[id(embed)], prefix + lists[0], head_path, last,
                        _beside(model, path, head_path), pre)
    raise ConfigError(f"{type(model).__name__}: cannot find a module holding both the input "
                      f"embedding and a list of {num_layers} decoder layers")


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _beside(model: nn.Module, text_path: str, head_path: Optional[str]) -> tuple[str, ...]:
    """Parameter-holding children of the text model's ancestors, other than the path down to
    it and the head: a VL model's vision tower and projector (first-stage tensors)."""
    out, parts = [], text_path.split(".") if text_path else []
    for depth in range(len(parts)):
        ancestor = ".".join(parts[:depth])
        module = model.get_submodule(ancestor)
        for name, child in module.named_children():
            path = f"{ancestor}.{name}" if ancestor else name
            if name != parts[depth] and path != head_path and _has_params(child):
                out.append(path)
    return tuple(out)


class _Absent(nn.Module):
    """A first-stage module (e.g. a vision tower) on a later stage: holds nothing."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PPLoaderError(f"{self.path} lives on the first pipeline stage; multimodal inputs "
                            "must be embedded there")


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _model_class(config: Any, model_class: Optional[type]) -> type:
    if model_class is not None:
        return model_class
    import transformers
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    raise ConfigError(f"config.json architectures {getattr(config, 'architectures', None)} name no "
                      "transformers class; pass model_class=", file="config.json")


def stage_skeleton(config: Any, window: StageWindow, *, dtype: torch.dtype,
                   model_class: Optional[type] = None, num_layers: Optional[int] = None
                   ) -> tuple[nn.Module, _Anatomy]:
    """The model on ``meta`` with everything outside ``window`` replaced (nothing allocated).

    ``num_layers``: the decoder layers (default: the config's ``num_hidden_layers``; the spec's
    count where they differ, e.g. a decoder of an encoder-decoder config)."""
    cls = _model_class(config, model_class)
    text = config.get_text_config()
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    model.eval()
    anatomy = _anatomy(model, num_layers or text.num_hidden_layers)
    layers = model.get_submodule(anatomy.layers)
    for i in range(len(layers)):
        if not window.owns(i):
            layers[i] = PassThrough(layers[i], i)
    if not window.has_embed:
        _set(model, anatomy.embed, _ZeroEmbedding(text.hidden_size, dtype))
        for path in anatomy.first_globals:
            _set(model, path, _Absent(path))
        for path in anatomy.pre_layers:  # run, but their output is replaced at the first layer
            model.get_submodule(path).to_empty(device="cpu").requires_grad_(False)
            for tensor in model.get_submodule(path).state_dict().values():
                tensor.zero_()
    if not window.has_head:
        for path in anatomy.last_globals + ((anatomy.head,) if anatomy.head else ()):
            _set(model, path, nn.Identity())
    return model, anatomy


def load_stage_weights(model: nn.Module, tensors: dict[str, torch.Tensor], *,
                       window: StageWindow, strict: bool = True, rank: Optional[int] = None
                       ) -> None:
    """Place checkpoint-named ``tensors`` into a stage skeleton the way ``from_pretrained`` does
    (transformers' conversion mapping), then build non-persistent buffers on the CPU."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging
    # dtype None: every tensor takes its skeleton parameter's dtype, as in from_pretrained
    config = LoadStateDictConfig(dtype=None, weight_mapping=get_model_conversion_mapping(model))
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        info, _ = convert_and_load_state_dict_in_model(model, tensors, config)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if window.has_embed and window.has_head and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    for key, buf in list(model.named_buffers()):
        if buf.is_meta and key not in model.state_dict():  # non-persistent: recomputed below
            parent, _, name = key.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._buffers[name] = torch.empty_like(buf, device="cpu")
    model.initialize_weights()
    meta = sorted(k for k, v in model.state_dict(keep_vars=True).items() if v.is_meta)
    unexpected = sorted(info.unexpected_keys) + [k for k, *_ in sorted(info.mismatched_keys)]
    errors = list(info.error_msgs) + [f"{k}: {v}" for k, v in info.conversion_errors.items()]
    if strict and (meta or unexpected or errors):
        detail = "; ".join(filter(None, [
            f"{len(meta)} parameter(s) not loaded: {', '.join(meta[:6])}" if meta else "",
            f"{len(unexpected)} tensor(s) the stage does not take: {', '.join(unexpected[:6])}"
            if unexpected else "", "; ".join(errors[:3])]))
        raise PlanError(f"stage {window.pp_rank} (layers {window.start_layer}-"
                        f"{window.end_layer - 1}): {detail}", rank=rank)


@dataclass
class HFStage:
    """A loaded stage: the model (only this stage's layers real), its window and read stats."""

    model: nn.Module
    window: StageWindow
    topology: Topology
    spec: ModelSpec
    plan: RankPlan
    stats: ReadStats
    layers: nn.ModuleList
    hidden_size: int

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def device(self) -> torch.device:
        """Where the stage's parameters live (move it with ``stage.model.to(...)``)."""
        return next(p.device for p in self.model.parameters() if not p.is_meta)

    def parameter_bytes(self) -> int:
        """Bytes of the materialised parameters (what this stage holds)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.is_meta)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, hidden_states: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        """Logits on the last stage; elsewhere the hidden states after this stage's layers.

        ``hidden_states`` (from the previous stage) is required off the first stage.
        """
        w = self.window
        if (hidden_states is None) != w.has_embed:
            raise ValueError(f"stage {w.pp_rank}: hidden_states must be given exactly when the "
                             "stage has no embedding")
        first, last = self.layers[w.start_layer], self.layers[w.end_layer - 1]

        def inject(_m: nn.Module, args: tuple, kw: dict) -> tuple[tuple, dict]:
            if "hidden_states" in kw:
                return args, {**kw, "hidden_states": hidden_states}
            return (hidden_states,) + tuple(args[1:]), kw

        def stop(_m: nn.Module, _args: tuple, out: Any) -> None:
            raise _StageDone(out[0] if isinstance(out, tuple) else out)

        handles = [] if w.has_head else [last.register_forward_hook(stop)]
        if hidden_states is not None:
            handles.append(first.register_forward_pre_hook(inject, with_kwargs=True))
        try:
            return self.model(input_ids=input_ids, use_cache=False, **kwargs).logits
        except _StageDone as done:
            return done.hidden
        finally:
            for h in handles:
                h.remove()


def build_stage(model_dir: os.PathLike | str, topology: Topology, *,
                window: Optional[StageWindow] = None, partition: Partition = "even",
                strict: bool = True, model_class: Optional[type] = None,
                window_bytes: Optional[int] = None, threads: int = 1,
                cancel: Optional[threading.Event] = None) -> HFStage:
    """Build and load this rank's stage of the transformers model in ``model_dir``.

    Reads only the stage's tensors (pploader plan + Reader); ``window`` overrides ``partition``.
    """
    from transformers import AutoConfig
    if topology.tp_size != 1 or topology.ep_size != 1:
        raise TopologyError(f"the transformers integration runs pure PP (tp = ep = 1); got "
                            f"{topology.describe()}", rank=topology.rank)
    spec = load_spec(model_dir)
    index = open_checkpoint(model_dir)
    if window is None:
        window = make_windows(spec, index, topology.pp_size, partition)[topology.pp_rank]
    plan = plan_rank(spec, index, topology, window, strict=strict)
    config = AutoConfig.from_pretrained(str(model_dir))
    if spec.tie_word_embeddings and not spec.for_checkpoint(index.weight_map).tie_word_embeddings:
        for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
            cfg.tie_word_embeddings = False  # the checkpoint stores its own head: read, not tied
    model, anatomy = stage_skeleton(config, window, dtype=spec.dtype, model_class=model_class,
                                    num_layers=spec.num_layers)
    reader = Reader(plan, window_bytes=window_bytes, threads=threads, cancel=cancel)
    tensors = dict(reader)
    if window.has_embed:  # a tied head aliased to the embedding: the embedding is needed too
        for item in plan.items:
            if item.name != item.target and item.name not in tensors:
                tensors[item.name] = tensors[item.target]
    load_stage_weights(model, tensors, window=window, strict=strict, rank=topology.rank)
    return HFStage(model, window, topology, spec, plan, reader.stats,
                   model.get_submodule(anatomy.layers), config.get_text_config().hidden_size)


def pipeline_forward(stage: HFStage, input_ids: torch.Tensor, comm: "Comm",
                     **kwargs: Any) -> Optional[torch.Tensor]:
    """One forward pass through the pipeline (called on every rank, same ``input_ids``).

    Stage k receives hidden states from stage k-1, runs its layers and sends to stage k+1;
    the last stage returns the logits, the others None.
    """
    t = stage.topology
    hidden = None
    if not stage.window.has_embed:
        hidden = torch.empty(*input_ids.shape, stage.hidden_size, dtype=stage.dtype,
                             device=stage.device)
        comm.recv(hidden, t.rank_of(t.pp_rank - 1))
    out = stage.forward(input_ids, hidden, **kwargs)
    if stage.window.has_head:
        return out
    comm.send(out.contiguous(), t.rank_of(t.pp_rank + 1))
    return None
