"""The training tab's multi-GPU section: multi_gpu, the layout of the ranks (DDP, sharded base, with CPU offload,
or auto by the memory plan), the `distributed` settings (a new one appears here with no view code), and what Start
will launch or why it refuses (modules/ui/RankLaunch.py). The memory line above it answers per GPU when it is on."""
from __future__ import annotations

import customtkinter as ctk

from modules.ui import RankLaunch as ranks
from modules.ui.ctk_components import ERROR_COLOR, BoundField, render_section
from modules.util.config.config_io import ConfigError


class CtkMultiGpuSection:
    def __init__(self, parent, app, row: int):
        self.app, self.state = app, app.config_state
        self.gpus = ranks.visible_gpus()
        box = ctk.CTkFrame(parent, fg_color="transparent")
        box.grid(row=row, column=0, columnspan=3, sticky="w", pady=(12, 0))
        ctk.CTkLabel(box, text="multi-GPU", font=ctk.CTkFont(weight="bold")).grid(row=0, column=0, sticky="w",
                                                                                padx=8)
        app.fields["multi_gpu"] = BoundField(box, self.state, "multi_gpu", 1, width=160, error_width=200)
        ctk.CTkLabel(box, text="layout", anchor="w", width=160).grid(row=2, column=0, sticky="w", padx=(8, 4))
        self.layout_menu = ctk.CTkOptionMenu(box, values=list(ranks.LAYOUTS), width=260,
                                             command=lambda name: ranks.set_layout(self.state, name))
        self.layout_menu.grid(row=2, column=1, columnspan=2, sticky="w", padx=4, pady=2)
        self.layout_error = ctk.CTkLabel(box, text="", text_color=ERROR_COLOR, anchor="w", justify="left",
                                         wraplength=200)
        self.layout_error.grid(row=2, column=3, sticky="w", padx=4)
        # the menu is the widget of both fields: it shows them (a fit or a loaded config changes them too)
        for path in ranks.LAYOUT_FIELDS:
            self.state.bind(path, lambda _text: self.layout_menu.set(ranks.layout_name(self.state)),
                            lambda message: self.layout_error.configure(text=message or ""))
        render_section(box, self.state, "distributed", skip=[p.rsplit(".", 1)[1] for p in ranks.LAYOUT_FIELDS],
                       start_row=3, fields=app.fields, width=160, error_width=200)
        self.label = ctk.CTkLabel(box, text="", anchor="w", justify="left", wraplength=540)
        self.label.grid(row=20, column=0, columnspan=3, sticky="w", padx=8, pady=(4, 0))
        self.refresh()

    def refresh(self) -> None:
        self.layout_menu.set(ranks.layout_name(self.state))
        try:
            config = self.state.config()
        except ConfigError as error:
            self.label.configure(text="fix the config first: " + "; ".join(error.problems[:2]))
            return
        self.label.configure(text="\n".join(ranks.section_lines(config, self.gpus)))

    def on_config_change(self, path: str) -> None:
        if path in ("", "multi_gpu", "device", "batch_size", "training_method", "workspace_dir") \
                or path.startswith("distributed.") or path.startswith("model."):
            self.refresh()
