"""One pipeline stage of a transformers model, loaded through pploader, and a pipeline forward.

Called on every rank of a PP job (TP = EP = 1: transformers modules are not TP-sharded)::

    stage = build_stage(model_dir, topology)        # meta skeleton, only this stage's layers real
    logits = pipeline_forward(stage, input_ids, comm)  # last stage gets logits, others None

How a stage is built (all model knowledge comes from transformers itself):

- the full model is instantiated on the ``meta`` device (no memory);
- the decoder layers are the model's one list of ``num_hidden_layers`` modules; every module
  off the path from the root to that list is placed by where its parent's ``forward`` first
  uses it (before the child leading to the layers: first stage, after: last; registration
  order where the forward does not name it), at every level: BERT-style models keep the
  embedding block in ``bert.embeddings`` and the layers in ``bert.encoder.layer``;
- decoder layers outside ``[start_layer, end_layer)`` become :class:`PassThrough` modules: no
  parameters, attribute reads fall through to the meta original (the model's own code reads
  ``layer.attention_type`` and the like);
- off the first stage the input embedding (every attribute holding it) becomes a zero source
  as wide as the embedding, the other first-stage modules of the text model (position
  embeddings, embedding norms, projections) zero-filled placeholders, those beside it (vision
  towers) absent; off the last stage the last-stage modules (final norm, head, BERT's ``cls``)
  are dropped;
- pploader plans and reads only this stage's tensors; transformers' own checkpoint conversion
  (renames, per-expert tensors stacked into fused 3-D params) places them, exactly as
  ``from_pretrained`` would; ties whose both ends are on the stage are applied;
  non-persistent buffers (``rotary_emb.inv_freq``, Falcon-H1's ``mup_vector``) are recomputed
  by the model's own initialiser, never loaded;
- strict by default: a parameter left on ``meta`` or a read tensor the model does not take is a
  :class:`~pploader.errors.PlanError` naming the tensors.

Every stage runs the model's own forward from ``input_ids`` (masks, positions and rotary
tables are computed locally); hooks on the decoder layers do the rest. A non-last stage stops
before layer ``end_layer`` and returns a :class:`StageBoundary`: everything the layer loop hands
that layer (positional and keyword arguments: hidden states, and whatever state the model
threads between layers) plus the last layer's output. The next stage's pass-throughs return
that output, the inputs of its first layer are replaced by the captured ones, and captured
tensors replace their local counterparts wherever later layers receive the same object (a
value computed once before the loop from the embedding; a slice of such a value travels
with its whole base, and later layers' slices are re-cut from it: Gemma 3n / 4's per-layer
inputs). A mapping object the layers fill (Gemma's ``KVSharingDict`` of shared K/V) travels
and refills the receiving stage's own object. Layers the loop skips (Mllama's
cross-attention layers in a text-only pass) may sit at a boundary: the stage stops at the
next layer that runs, or, where none does, sends only the last layer output. Parameters held
directly by an ancestor of the layers (ZAYA's input scale) are placed like modules; another
stage's are zero placeholders. So any model whose parent forward calls the layers in order
is split exactly. Refused with a :class:`~pploader.errors.PPLoaderError`:
a forward that runs a layer of an earlier stage after a later one (Dory's layer loops across
a boundary). Not detected: loop state derived from an earlier stage's intermediate layer
outputs other than the last (no transformers model found in the sweep does this), and an
ancestor's module or parameter of the last stage used inside the layer loop (it is a
placeholder on earlier stages).
Boundaries travel through :class:`~pploader.distributed.comm.Comm` ``send``/``recv``
(``hf_boundary.py``): masks and rotary tables too, not only hidden states.
"""
from __future__ import annotations

import functools
import os
import threading
import typing
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..planning.checkpoint import open_checkpoint
from ..errors import ConfigError, PlanError, PPLoaderError, TopologyError
from ..families.hf_meta import find_layers_path, forward_order
from ..planning.partition import StageWindow
from ..planning.plan import Partition, RankPlan, plan_rank
from ..planning.stage import stage_window
from ..io.backend import ReadOptions, ReadStats
from ..io.registry import open_backend
from ..planning.spec import ModelSpec, load_spec
from ..planning.topology import Topology
from .hf_boundary import StageBoundary, StageDone, StageRun, recv_boundary, send_boundary
from .hf_placeholders import AbsentModule, DroppedModule, PassThrough, ZeroEmbedding

if typing.TYPE_CHECKING:  # pragma: no cover
    from ..distributed.comm import Comm

__all__ = ["PassThrough", "HFStage", "StageBoundary", "stage_skeleton", "load_stage_weights",
           "build_stage", "pipeline_forward"]


@dataclass(frozen=True)
class _Anatomy:
    """Where the stage-relevant modules of a transformers model live (dotted paths).

    Modules off the path from the root to the layer list are placed by where their parent's
    ``forward`` first uses them (before the child leading to the layers: first stage; after:
    last), falling back to registration order."""

    text_model: str      # the lowest common ancestor of the input embedding and the layers
    embed: str
    layers: str
    head: Optional[str]
    last_globals: tuple[str, ...]   # last-stage modules (final norm; BERT's ``cls``), not the head
    first_globals: tuple[str, ...]  # first-stage modules beside the text model (vision)
    pre_layers: tuple[str, ...] = ()  # first-stage modules in the text model run before the
                                      # layers (embedding norms, positions; BERT's embeddings)
    embed_aliases: tuple[str, ...] = ()  # every attribute path holding the input embedding
    # parameters / persistent buffers held directly by the layers' ancestors (ZAYA's
    # ``model.input_hidden_states_scale``), by the stage their forward uses them on
    first_tensors: tuple[str, ...] = ()
    last_tensors: tuple[str, ...] = ()


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _anatomy(model: nn.Module, num_layers: int) -> _Anatomy:
    embed = model.get_input_embeddings()  # type: ignore[operator]
    aliases = tuple(n for n, m in model.named_modules(remove_duplicate=False) if m is embed)
    try:
        layers = find_layers_path(model, num_layers)
    except ConfigError as exc:
        raise ConfigError(f"{type(model).__name__}: cannot find the list of {num_layers} decoder "
                          f"layers ({exc})") from None
    if not aliases:
        raise ConfigError(f"{type(model).__name__}: the input embedding is not a submodule")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_path = next((n for n, m in model.named_modules() if m is head), None) \
        if head is not None else None
    parts = layers.split(".")

    def shared_depth(path: str) -> int:
        depth = 0
        for a, b in zip(path.split("."), parts):
            if a != b:
                break
            depth += 1
        return depth
    embed_path = max(aliases, key=shared_depth)  # the alias closest to the layers
    lca_depth = shared_depth(embed_path)
    first: list[str] = []
    beside: list[str] = []
    last: list[str] = []
    tensors: dict[str, list[str]] = {"first": [], "last": []}
    keys = list(model.state_dict(keep_vars=True))
    first_layer_key = next((i for i, k in enumerate(keys) if k.startswith(layers + ".")),
                           len(keys))
    for depth in range(len(parts)):
        parent, child = ".".join(parts[:depth]), parts[depth]
        module = model.get_submodule(parent)
        called = forward_order(model, _join(parent, child))
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n in module._buffers if n not in module._non_persistent_buffers_set]
        for name in own:  # placed as hf_meta places them: forward use, else saved order
            path = _join(parent, name)
            position = keys.index(path) if path in keys else len(keys)
            tensors[called.get(path, "first" if position < first_layer_key else "last")
                    ].append(path)
        order = [n for n, _ in module.named_children()]
        for name, sub in module.named_children():
            path = _join(parent, name)
            if name == child or path == head_path or not _has_params(sub):
                continue
            holds_embed = any(a == path or a.startswith(path + ".") for a in aliases)
            side = called.get(path, "first" if order.index(name) < order.index(child) else "last")
            if holds_embed or side == "first":
                (first if holds_embed or depth >= lca_depth else beside).append(path)
            else:
                last.append(path)
    return _Anatomy(".".join(parts[:lca_depth]), embed_path, layers, head_path, tuple(last),
                    tuple(beside), tuple(first), aliases, tuple(tensors["first"]),
                    tuple(tensors["last"]))


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


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
        weight = getattr(model.get_submodule(anatomy.embed), "weight", None)
        rows, width = (weight.shape if isinstance(weight, torch.Tensor) and weight.dim() == 2
                       else (text.vocab_size, text.hidden_size))
        zero = ZeroEmbedding(rows, width, dtype)  # ELECTRA, RemBERT: narrower than hidden
        for path in anatomy.embed_aliases:
            _set(model, path, zero)
        for path in anatomy.first_globals:
            _set(model, path, AbsentModule(model.get_submodule(path), path))
        for path in anatomy.pre_layers:  # run, but the next layer's inputs are replaced
            if path in anatomy.embed_aliases:
                continue
            module = model.get_submodule(path).to_empty(device="cpu").requires_grad_(False)
            for tensor in module.state_dict().values():
                tensor.zero_()
    # an ancestor's own tensors of another stage: zero placeholders (never loaded); before the
    # layers their result is replaced by the received inputs, after them never reached
    for path in (() if window.has_embed else anatomy.first_tensors) + \
            (() if window.has_head else anatomy.last_tensors):
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        meta = getattr(owner, name)
        zeros = torch.zeros(meta.shape, dtype=meta.dtype, device="cpu")
        if name in owner._parameters:
            owner._parameters[name] = nn.Parameter(zeros, requires_grad=False)
        else:
            owner._buffers[name] = zeros
    if not window.has_head:
        done: list[str] = []
        for path in anatomy.last_globals + ((anatomy.head,) if anatomy.head else ()):
            if not any(path == d or path.startswith(d + ".") for d in done):
                _set(model, path, DroppedModule(model.get_submodule(path)))
                done.append(path)
    return model, anatomy


def load_stage_weights(model: nn.Module, tensors: dict[str, torch.Tensor], *,
                       window: StageWindow, strict: bool = True, rank: Optional[int] = None,
                       unrun: frozenset[str] = frozenset()) -> None:
    """Place checkpoint-named ``tensors`` into a stage skeleton the way ``from_pretrained`` does
    (transformers' conversion mapping), then build non-persistent buffers on the CPU.
    ``unrun`` (``Family.unrun``): parameters the stage's layers hold but never run (Zamba2's
    other hybrid layers' adapters), not read: left as zeros, not counted as missing."""
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
    _tie_local(model)
    for key, buf in list(model.named_buffers()):
        if buf.is_meta and key not in model.state_dict():  # non-persistent: recomputed below
            parent, _, name = key.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._buffers[name] = torch.empty_like(buf, device="cpu")
    model.initialize_weights()
    for key, value in model.state_dict(keep_vars=True).items():
        if value.is_meta and key in unrun:
            parent, _, name = key.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._parameters[name] = nn.Parameter(torch.zeros_like(value, device="cpu"),
                                                   requires_grad=False)
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


def _tie_local(model: nn.Module) -> None:
    """Tie the pairs of ``all_tied_weights_keys`` whose both ends are on this stage and whose
    target was not loaded (ProphetNet's decoder embedding is a tied copy of the wrapper's)."""
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        try:
            target_param, source_param = model.get_parameter(target), model.get_parameter(source)
        except AttributeError:  # one end replaced on this stage
            continue
        if target_param.is_meta and not source_param.is_meta:
            parent, _, name = target.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            owner._parameters[name] = source_param


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
    def forward(self, input_ids: torch.Tensor, boundary: Optional[StageBoundary] = None,
                **kwargs: Any) -> "torch.Tensor | StageBoundary":
        """Logits on the last stage; elsewhere the :class:`StageBoundary` for the next stage.

        ``boundary`` (the previous stage's result) is required exactly off the first stage.
        The model's own forward runs on every stage (masks, positions, rotary tables are
        recomputed from ``input_ids`` and ``kwargs``); hooks on the decoder layers stop it
        before the next stage's first layer and, on a later stage, replace the inputs of this
        stage's first layer with the captured ones.
        """
        w = self.window
        if (boundary is None) != w.has_embed:
            raise ValueError(f"stage {w.pp_rank}: a boundary must be given exactly when the "
                             "stage has no embedding")
        if boundary is not None and not w.start_layer <= boundary.layer <= w.end_layer:
            raise PPLoaderError(f"stage {w.pp_rank} runs layers {w.start_layer}-{w.end_layer - 1}"
                                f"; the boundary received is for layer {boundary.layer}",
                                rank=self.topology.rank)
        if boundary is not None and boundary.layer >= w.end_layer and not w.has_head:
            return boundary  # the loop skips all of this stage's layers: handed on as it is
        run = StageRun(w, boundary, self.topology.rank)
        handles = []
        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(
                functools.partial(run.before, i), with_kwargs=True))
            if w.owns(i):
                handles.append(layer.register_forward_hook(functools.partial(run.after, i)))
        replay = boundary.output() if boundary is not None else None
        for i in range(w.start_layer):
            self.layers[i].replay(replay)
        try:
            out = self.model(input_ids=input_ids, use_cache=False, **kwargs)
        except StageDone as done:
            return done.boundary
        finally:
            for h in handles:
                h.remove()
            for i in range(w.start_layer):
                self.layers[i].replay(None)
        if not w.has_head:
            # the loop skipped every later layer: the output of the last layer run travels
            # (the receiving stage's pass-throughs return it to the code after the loop)
            if run.ran_owned:
                return StageBoundary.capture(w.end_layer, None, None, run.last_output)
            if boundary is not None and boundary.layer >= w.start_layer:
                return StageBoundary.capture(w.end_layer, None, None, replay)
            raise PPLoaderError(f"stage {w.pp_rank}: the model's forward never ran layer "
                                f"{w.end_layer}", rank=self.topology.rank)
        return out.logits


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
        window = stage_window(spec, index, topology, partition)
    plan = plan_rank(spec, index, topology, window, strict=strict)
    config = AutoConfig.from_pretrained(str(model_dir))
    if spec.tie_word_embeddings and not spec.for_checkpoint(index.weight_map).tie_word_embeddings:
        for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
            cfg.tie_word_embeddings = False  # the checkpoint stores its own head: read, not tied
    model, anatomy = stage_skeleton(config, window, dtype=spec.dtype, model_class=model_class,
                                    num_layers=spec.num_layers)
    reader = open_backend(plan, "cpu", ReadOptions(window_bytes=window_bytes, threads=threads,
                                                 cancel=cancel))
    tensors = dict(reader)
    if window.has_embed:  # a tied head aliased to the embedding: the embedding is needed too
        for item in plan.items:
            if item.name != item.target and item.name not in tensors:
                tensors[item.name] = tensors[item.target]
    load_stage_weights(model, tensors, window=window, strict=strict, rank=topology.rank,
                       unrun=spec.for_checkpoint(index.weight_map).family.unrun)
    return HFStage(model, window, topology, spec, plan, reader.stats,
                   model.get_submodule(anatomy.layers), config.get_text_config().hidden_size)


def pipeline_forward(stage: HFStage, input_ids: torch.Tensor, comm: "Comm",
                     **kwargs: Any) -> Optional[torch.Tensor]:
    """One forward pass through the pipeline (called on every rank, same ``input_ids``).

    Stage k receives the :class:`StageBoundary` from stage k-1, runs its layers and sends its
    own to stage k+1; the last stage returns the logits, the others None.
    """
    t = stage.topology
    boundary = None
    if not stage.window.has_embed:
        boundary = recv_boundary(comm, t.rank_of(t.pp_rank - 1), stage.device)
    out = stage.forward(input_ids, boundary, **kwargs)
    if stage.window.has_head:
        assert isinstance(out, torch.Tensor)
        return out
    assert isinstance(out, StageBoundary)
    send_boundary(comm, out, t.rank_of(t.pp_rank + 1), stage.device)
    return None
