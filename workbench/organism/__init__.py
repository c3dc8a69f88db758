"""A trained model organism: a synthetic visual-QA corpus and a small Qwen3-VL trained on it.

    python -m workbench.organism.corpus --out data/organism --seed 0 --train 4000 --val 200 --test 200
    python -m workbench.organism.train --variant instruct [--steps N] [--out DIR]

`workbench.organism.corpus` writes the corpus; `workbench.organism.train` trains and caches the organism
(`ensure_organism`). Nothing is imported here, so importing the package costs nothing.
"""
