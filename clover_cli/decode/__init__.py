"""Speculative decoding: the exact math (verify.py), the budget policy (budget.py) and the loop (engine.py), over
the token trees of ../tree.py."""
