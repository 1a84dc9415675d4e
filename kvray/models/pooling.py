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


def model_pooling(model_dir: str | Path | None, classify: bool = False) -> ModelPooling:
    """The checkpoint's pooling (see the module docstring); the defaults where it says
    nothing or is not a directory (a GGUF file)."""
    if classify:
        return ModelPooling("last", False)
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
