"""The book's instruments: benches, the HF reference, cost arithmetic, run labels and table and
figure I/O, plots, and the designs the engine replaced. It imports the engine; the engine never
imports it. A chapter's first cell imports from here and from the one bench it runs.

- `timing`: the one decode timing loop (`prefill`, `timed_steps`) and the clocks around it
- `reference`: HF transformers, and nanolab's greedy decode beside it
- `costs`: rebuild cells, padding, workspace bytes, streamed work, the seed's tables
- `report`: run labels, data/ and figures/ I/O
- `plots`: one module of figures per chapter
- `history`: the unplanned decode (Days 49 and 50's "before"), as a runner the engine accepts
- `decodebench`, `compilebench`, `capturebench`, `streambench`: the benches
"""

from nanolab.gates import Gate
from nanolab.lab.reference import engine_greedy, hf_greedy, load_hf, nanolab_greedy
from nanolab.lab.report import (
    chapter_target,
    committed_tables,
    load_table,
    run_label,
    save_figure,
    save_table,
    show,
    table_label,
)
from nanolab.lab.timing import drain, prefill, random_prompts, time_engine

__all__ = ["Gate", "chapter_target", "committed_tables", "drain", "engine_greedy", "hf_greedy", "load_hf",
           "load_table", "nanolab_greedy", "prefill", "random_prompts", "run_label", "save_figure", "save_table",
           "show", "table_label", "time_engine"]
