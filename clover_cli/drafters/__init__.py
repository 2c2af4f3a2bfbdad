"""Drafters propose token trees for the target to verify; every drafter implements one protocol (base.py).

    base.py      the protocol (Drafter, every optional hook with its default) and NoDrafter
    factory.py   the one place a drafter is made from a name
    registry.py  what is done with heads by family: which class runs each, how its heads are built, loaded and
                 saved (the families themselves: one line each in ../families.py)
    merged.py    MergedDrafter (the default: heads with n-gram lookup) and ChoiceStats
    the family files (clover2.py, medusa.py, eagle.py, eagle3.py), ngram.py, draft_model.py, self_draft.py

Nothing is imported here (the drafters' names, which options.py reads before torch loads, come from
../families.py, which imports nothing either).
"""
