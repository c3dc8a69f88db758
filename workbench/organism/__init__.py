"""A trained model organism: a synthetic visual-QA corpus (and, later, a tiny Qwen3-VL trained on it).

    python -m workbench.organism.corpus --out data/organism --seed 0 --train 4000 --val 200 --test 200

Only the corpus exists so far (`workbench.organism.corpus`); nothing is imported here, so importing the
package costs nothing.
"""
