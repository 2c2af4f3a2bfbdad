"""Speculative decoding: the exact math (verify.py), the budget policy (budget.py), the loop (engine.py) and the token
tree they pass around (tree.py)."""
