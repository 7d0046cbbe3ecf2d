"""Loading a transformers model (and its tokenizer) with its model patch applied."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import apply_patch, resolve_patch
from layerwise.model_io.heads import checkpoint_class, dropped_keys_error
from layerwise.model_io.load_errors import explained
from layerwise.model_io.model_paths import check_model_path


def load_model(path_or_id: str | os.PathLike, dtype: torch.dtype | str | None = "auto",
               patch: ModelPatch | str | bool | None = None, **kwargs: Any) -> torch.nn.Module:
    """Load a transformers model from a folder or hub id and apply its model patch.

    The class is the one ``architectures`` names, else the task class whose weight names
    the folder's checkpoint holds (so a missing ``architectures`` never drops ``lm_head``);
    checkpoint weights the class does not use are a :class:`ModelLoadError` naming them.

    ``patch``: ``None`` picks the registered patch for the model's architecture,
    a name or :class:`ModelPatch` forces one, ``False`` disables patching.
    ``trust_remote_code`` stays off (and transformers never prompts for it) unless the
    caller passes ``trust_remote_code=True`` after reading the model's code.
    A folder whose pruned weights are stored ``sparse-bitmask`` / ``sparse-24-bitmask`` (layerwise 0.1.0) is
    decoded first (:mod:`layerwise.model_io.compressed_loading`): transformers alone would leave them random;
    the layers a ``dense`` sparsity_config names are marked pruned again.
    """
    import transformers

    from layerwise.model_io.compressed_loading import load_sparse, mark_dense_sparse, sparse_format

    where = str(path_or_id)
    check_model_path(where)
    trust = kwargs.pop("trust_remote_code", False)
    with explained(where):  # what is recognised (an OSError too) is explained, the rest re-raised as it was
        config = transformers.AutoConfig.from_pretrained(where, trust_remote_code=trust)
        if sparse_format(config) is not None:
            model, info = load_sparse(Path(where).expanduser(), config, dtype=dtype, trust_remote_code=trust,
                                      output_loading_info=True, **kwargs)
        else:
            cls = checkpoint_class(config, Path(where).expanduser())
            model, info = cls.from_pretrained(where, dtype=dtype, trust_remote_code=trust,
                                              output_loading_info=True, **kwargs)
            mark_dense_sparse(model, config)
    dropped = list(info.get("unexpected_keys") or [])
    if dropped:  # weights the class does not use would be missing from the saved model
        raise dropped_keys_error(where, type(model), dropped)
    model.eval()
    return apply_patch(model, resolve_patch(model, patch))


def load_tokenizer(path_or_id: str | os.PathLike, trust_remote_code: bool = False) -> Any | None:
    """The tokenizer saved with a model, or ``None`` when the folder has none."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None
