"""The chapters' figures (matplotlib only), one module per chapter, drawn from live engine state
and measured tables."""

from nanolab.lab.plots.capture import plot_capture_buckets
from nanolab.lab.plots.engine import plot_block_tables, plot_decode_speed
from nanolab.lab.plots.floor import (
    between_steps_timeline,
    lever_run_waterfall,
    plot_between_steps,
    plot_chunked_itl,
    plot_floor_roofline,
    plot_folds,
    plot_kernel_draws,
    plot_lever_waterfall,
    plot_mixed_anatomy,
    plot_mixed_host,
    plot_mixed_steps,
    plot_projections,
    plot_tuning_spread,
)
from nanolab.lab.plots.parallel import plot_paper_speedup, plot_tp_steps
from nanolab.lab.plots.plan import plot_decode_plan
from nanolab.lab.plots.prefix import plot_nohit_throughput, plot_prefix_ttft, plot_shared_blocks
from nanolab.lab.plots.results import plot_headline
from nanolab.lab.plots.streamed import plot_launch_sweep, plot_streamed_engine, plot_streamed_read
from nanolab.lab.plots.tail import plot_itl_cdf, plot_startup

__all__ = ["between_steps_timeline", "lever_run_waterfall", "plot_between_steps", "plot_block_tables",
           "plot_capture_buckets", "plot_chunked_itl", "plot_decode_plan", "plot_decode_speed",
           "plot_floor_roofline", "plot_folds", "plot_headline", "plot_itl_cdf", "plot_kernel_draws",
           "plot_launch_sweep", "plot_lever_waterfall", "plot_mixed_anatomy", "plot_mixed_host",
           "plot_mixed_steps", "plot_nohit_throughput", "plot_paper_speedup", "plot_prefix_ttft",
           "plot_projections", "plot_shared_blocks", "plot_startup",
           "plot_streamed_engine", "plot_streamed_read", "plot_tp_steps", "plot_tuning_spread"]
