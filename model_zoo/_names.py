"""Ignore entries the zoo's patches share.

A vision-language model's head is the module ``lm_head``, but transformers 5 saves (and most published
checkpoints hold) it as ``language_model.lm_head``: transformers renames the tensors on load and back on save.
An in-memory run sees the first name, a model-free run (which reads the checkpoint's tensor names) the second;
one pattern matches both.
"""

LM_HEAD = "re:(language_model\\.)?lm_head$"
