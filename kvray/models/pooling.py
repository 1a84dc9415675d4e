"""How a model pools its hidden states into one vector, read from its checkpoint.

A sentence-transformers checkpoint says it in ``modules.json``: a ``Pooling`` module whose
folder's ``config.json`` sets one ``pooling_mode_*`` flag (``lasttoken``, ``mean_tokens``,
``cls_token``), and a ``Normalize`` module when embeddings are L2-normalised. Without one, a
decoder embeds with its last token, normalised (what decoder embedding models use);
a ``*ForSequenceClassification`` model scores its last token, unnormalised.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kvray.models")

_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class ModelPooling:
    pooling_type: str = "last"
    normalize: bool = True
    # a classifier's scores from its logits: sigmoid, softmax or identity (see
    # :func:`classify_activation`)
    activation: str = "softmax"


_ACTIVATIONS = {"Sigmoid": "sigmoid", "Softmax": "softmax", "Identity": "identity",
                "Tanh": "tanh"}


def activated(logits: list[float], activation: str) -> list[float]:
    """Class scores from a classifier's logits by ``activation`` (sigmoid, softmax or
    identity)."""
    if activation == "sigmoid":
        return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
                for x in logits]
    if activation == "tanh":
        return [math.tanh(x) for x in logits]
    if activation == "softmax" and logits:
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]
    return list(logits)


def cosine_similarity(a: list[float], b: list[float]) -> float:
    """The cosine of the angle between two vectors (0 when one is zero)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def classify_activation(model_dir: str | Path | None) -> str:
    """How a ``*ForSequenceClassification`` checkpoint turns logits into scores, as vLLM
    reads it: the config's ``problem_type`` first (none for ``regression``, a sigmoid for
    multi-label, softmax — a sigmoid for one label — for single-label), else the
    activation a sentence-transformers cross-encoder names
    (``sentence_transformers.activation_fn``, else the older
    ``sbert_ce_default_activation_function``), else a sigmoid for one label (a reranker),
    softmax for more."""
    config_file = Path(model_dir) / "config.json" if model_dir is not None else None
    try:
        config = json.loads(config_file.read_text()) if config_file is not None \
            and config_file.is_file() else {}
    except (OSError, ValueError):
        config = {}
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    problem = config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem != "single_label_classification":
        named = str((config.get("sentence_transformers") or {}).get("activation_fn")
                    or config.get("sbert_ce_default_activation_function") or "")
        if named.rsplit(".", 1)[-1] in _ACTIVATIONS:
            return _ACTIVATIONS[named.rsplit(".", 1)[-1]]
    return "sigmoid" if labels == 1 else "softmax"


def model_pooling(model_dir: str | Path | None, classify: bool = False) -> ModelPooling:
    """The checkpoint's pooling (see the module docstring); the defaults where it says
    nothing or is not a directory (a GGUF file)."""
    if classify:
        return ModelPooling("last", False, classify_activation(model_dir))
    root = Path(model_dir) if model_dir is not None else None
    modules_file = root / "modules.json" if root is not None and root.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return ModelPooling()
    try:
        modules = json.loads(modules_file.read_text())
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        extra = sorted(set(kinds) - _KNOWN_MODULES)
        if extra:  # e.g. a Dense projection after pooling: embeddings would be wrong
            raise ValueError(f"sentence-transformers module(s) {extra} are not supported "
                             f"(kvray runs {', '.join(sorted(_KNOWN_MODULES))})")
        pooling_type = ModelPooling.pooling_type
        if "Pooling" in kinds:
            config = json.loads((root / kinds["Pooling"] / "config.json").read_text())
            chosen = [mode for key, mode in _MODES.items() if config.get(key)]
            unsupported = [k for k, v in config.items()
                           if k.startswith("pooling_mode_") and v and k not in _MODES]
            if unsupported or len(chosen) != 1:
                raise ValueError(f"pooling {unsupported or chosen} is not supported "
                                 "(one of last token, mean, cls)")
            pooling_type = chosen[0]
        return ModelPooling(pooling_type, "Normalize" in kinds)
    except (OSError, ValueError, AttributeError, TypeError) as err:
        raise ValueError(f"{modules_file}: cannot read the sentence-transformers pooling "
                         f"config: {err}") from None
