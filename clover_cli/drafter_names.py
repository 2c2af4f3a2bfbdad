"""The drafters' names, as --draft, chat's /draft and their help texts take them: one tuple, in a module of its own
that imports nothing (options.py checks --draft before the model and torch load; the families are in drafters/)."""

# a heads drafter's name -> the heads family (registry.FAMILIES, the heads config's "architecture") it runs
HEADS_DRAFTS = {"clover": "clover2", "medusa": "medusa", "eagle": "eagle", "eagle3": "eagle3"}
# auto: the model's heads merged with n-gram lookup when it has heads, else ngram; model: a smaller draft model
# (drafters/draft_model.py); self: the target with layers skipped as its own draft (drafters/self_draft.py)
DRAFTS = ("auto", *HEADS_DRAFTS, "ngram", "model", "self", "none")
