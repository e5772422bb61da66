"""The end-of-run panel between the bottom bar and the log: what the run did (its plan, "resumed from step N"), the
files it wrote and the next commands (the terminal's end report), with "open output folder" and a tools-tab sample
form prefilled with the new LoRA."""
from __future__ import annotations

from pathlib import Path

import customtkinter as ctk

from modules.ui.ctk_components import button


class CtkRunEndPanel:
    def __init__(self, app):
        self.app = app
        self.frame = ctk.CTkFrame(app, border_width=1, border_color="#2e7d32")
        self.frame.grid_columnconfigure(0, weight=1)
        self.text = ctk.CTkTextbox(self.frame, height=160, wrap="none")
        self.text.grid(row=0, column=0, rowspan=3, sticky="ew", padx=6, pady=6)
        button(self.frame, "open output folder", app.open_output_folder, width=150).grid(row=0, column=1, padx=6,
                                                                                      pady=2)
        self.sample_button = button(self.frame, "sample it (tools tab)", self.prefill_sample_form, width=150)
        self.sample_button.grid(row=1, column=1, padx=6, pady=2)
        button(self.frame, "close", self.hide, width=150).grid(row=2, column=1, padx=6, pady=2)
        self.written: list[str] = []
        self.shown = False

    def show(self, payload: dict, run) -> None:
        self.written = list(payload["written"])
        # the whole plan the terminal printed at the start, else its numbers
        plan = run.plan_text.rstrip() or f"run plan: {run.total_steps} steps over {run.epochs} epoch(s)"
        if run.resumed_from:
            plan += f"; resumed from step {run.resumed_from}"
        self.text.configure(state="normal")
        self.text.delete("1.0", "end")
        self.text.insert("end", plan + "\n" + (payload.get("report") or "\n".join(f"wrote {p}" for p in self.written)))
        self.text.configure(state="disabled")
        state = "normal" if self.app.config_state.get("training_method") in ("LORA", "FINE_TUNE") and self.written \
            else "disabled"
        self.sample_button.configure(state=state)
        self.frame.grid(row=3, column=0, sticky="ew", padx=6, pady=2)
        self.shown = True

    def hide(self) -> None:
        self.frame.grid_remove()
        self.shown = False

    def prefill_sample_form(self) -> None:
        """The tools tab's "sample a model" form with the base model and the new LoRA (or the fine-tuned model),
        and for a LoRA its "compare" form (the run's samples file, so the grids have the previews' sizes)."""
        state = self.app.config_state
        values = self.app.tools_view.values
        first = self.written[0]
        if state.get("training_method") == "LORA":
            values["sample.base model"].set(state.get("model.base_model_name") or "")
            values["sample.loras"].set(first)
        else:
            values["sample.base model"].set(first)
            values["sample.loras"].set("")
        samples = self.app.sampling.samples   # the run's first preview prompt, at its size
        if samples:
            for name in ("prompt", "width", "height", "frames"):
                if samples[0].get(name) not in (None, ""):
                    values[f"sample.{name}"].set(str(samples[0][name]))
        values["sample.output dir"].set(str(Path(state.get("workspace_dir") or "workspace") / "tool-samples"))
        if state.get("training_method") == "LORA":   # and the comparison of strengths, on the run's samples
            values["compare.base model"].set(state.get("model.base_model_name") or "")
            values["compare.loras"].set(first)
            if samples:
                values["compare.samples file"].set(str(self.app.sampling.samples_file()))
        self.app.tabview.set("tools")
