"""The project's own generated tasks: one generator per skill (arith, yesno, code, boxed, vision) and
the corpus that splits their items into held-out evaluation items and training items.

Scoring (evalsuite.scoring.heldout, the task YAMLs) and training (evalsuite.zoo) both read them from
here, so evaluation does not depend on the training code.
"""
