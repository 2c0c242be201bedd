"""Training the embedded default model: a small qwen35 code target and its DFlash drafter.

`python -m tools.train.pipeline --out DIR` runs every stage (corpus, tokenizer, target, drafter, export,
eval); each stage is also a module of its own. Needs torch + transformers (see the `train` extra).
"""
