# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Results
#
# Each chapter's headline numbers, read from the tables committed in `data/` by
# `nanolab.lab.results`. Nothing on this page is typed by hand: every value is computed from its
# source file when the book is built, and every row carries the label of the run that measured it.

# %%
import nanolab.lab as lab

table, missing = lab.headline_table("h200")
lab.show(table.set_index(["chapter", "result"]))
for source in missing:
    print(f"not shown, no table: {source}")

# %% [markdown]
# The model column says whether the weights were real or synthesized at the real shapes: a
# synthesized model's speed is the real one's, its outputs are meaningless. Every row is the
# H200's unless its device column names another machine: Day 61's CPU target, measured on the
# 2-core CPU it names, and results measured on an H100 on days no H200 could be started (counted
# below). Ratios read as the peer's time over nanolab's, so above 1 means nanolab is faster.

# %%
others = table[table.device != "NVIDIA H200"]
print(f"{len(others)} of {len(table)} rows come from another machine: "
      + "; ".join(f"{device} ({n})" for device, n in others.device.value_counts().items()))
