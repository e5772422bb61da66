"""The control tab: the settings of control and character models (`data.control`: derive, loss region;
Wan2.2-Animate's `animate`) and a live preview: a chosen item of a concept beside its control, mask and references
(VACE), its control (Wan-Fun Control), pose, face and reference (Animate) or driving video and reference
(Animate-2), on one frame slider (CtkCompanionStrip); the mode menu offers the modes the model trains;
a clip without a control file shows the control data.control.derive computes from it, with the cache's own
function. The concept's items are listed by the data loader's own scan in a worker thread (DatasetBrowser.browse),
as the dataset viewer does."""
from __future__ import annotations

from pathlib import Path

import customtkinter as ctk

from modules.ui import DatasetBrowser as browser
from modules.ui.ctk_components import button, in_worker, render_section
from modules.ui.CtkCompanionStrip import CtkCompanionStrip
from modules.ui.ItemCompanions import control_sections, kind_of, viewer_variant
from modules.ui.variant_text import animate_mode_choices
from modules.util.config.config_io import ConfigError

NO_ITEMS = "(no items)"


class CtkControlView:
    def __init__(self, frame, app):
        self.app, self.state = app, app.config_state
        settings = ctk.CTkFrame(frame, fg_color="transparent")
        settings.grid(row=0, column=0, sticky="nw")
        # each section in its own box: shown for the model's kind of control only (show_sections), all until known
        self.sections: dict[str, tuple[ctk.CTkFrame, ctk.CTkLabel]] = {}
        for row, (path, title) in enumerate(control_sections()):
            box = ctk.CTkFrame(settings, fg_color="transparent")
            box.grid(row=row, column=0, sticky="w")
            label = ctk.CTkLabel(box, text=title, font=ctk.CTkFont(weight="bold"))
            label.grid(row=0, column=0, columnspan=3, sticky="w", padx=8, pady=(10, 2))
            end = render_section(box, self.state, path, start_row=1, fields=app.fields, width=200, error_width=300)
            self.sections[path] = (box, label)
            if path == "animate":   # what the model's modes leave out (Animate-2: replace), said under the menu
                self.mode_note = ctk.CTkLabel(box, text="", anchor="w", justify="left", wraplength=560,
                                              text_color=("#a85a00", "#ffb74d"))
                self.mode_note.grid(row=end, column=0, columnspan=3, sticky="w", padx=8)
        self.vace_note = ctk.CTkLabel(settings, text="VACE LoRA: lora.targets vace trains the VACE blocks alone (LoRA "
                                                     "tab); the samples' control_scale sets the control's strength in "
                                                     "previews", anchor="w", justify="left", wraplength=560)
        self.vace_note.grid(row=len(self.sections), column=0, sticky="w", padx=8, pady=(8, 0))
        preview = ctk.CTkFrame(frame)
        preview.grid(row=1, column=0, columnspan=3, sticky="nw", padx=8, pady=10)
        bar = ctk.CTkFrame(preview, fg_color="transparent")
        bar.grid(row=0, column=0, sticky="w", padx=4, pady=4)
        ctk.CTkLabel(bar, text="preview: concept").grid(row=0, column=0, padx=4)
        self.concept_menu = ctk.CTkOptionMenu(bar, values=["0"], width=200, command=lambda _v: self.load_items())
        self.concept_menu.grid(row=0, column=1, padx=4)
        ctk.CTkLabel(bar, text="item").grid(row=0, column=2, padx=4)
        self.item_menu = ctk.CTkOptionMenu(bar, values=[NO_ITEMS], width=260, command=self.choose)
        self.item_menu.grid(row=0, column=3, padx=4)
        button(bar, "Scan again", self.load_items, width=100).grid(row=0, column=4, padx=4)
        self.note = ctk.CTkLabel(preview, text="", anchor="w", justify="left", wraplength=1000)
        self.note.grid(row=1, column=0, sticky="w", padx=8)
        self.strip = CtkCompanionStrip(preview, row=2)
        self.items: list[browser.DatasetItem] = []
        self.kind = ""
        self.loaded = False
        self.stale = True   # the scan probes every file of the concept: made when the tab is shown, not before
        self.refresh()
        self._watch()

    def _watch(self) -> None:
        if not self.note.winfo_exists():
            return
        if self.stale and self.app.tabview.get() == "control":
            self.load_items()
        self.note.after(300, self._watch)

    def refresh(self) -> None:
        """After a load: the concept menu follows the config's concepts; the first concept's items are listed
        when the tab is shown."""
        titles = [f"{i}: {self.app.concepts.title(i)}" for i in range(len(self.app.concepts.concepts()))]
        self.concept_menu.configure(values=titles or ["(no concept)"])
        if self.concept_menu.get() not in titles:
            self.concept_menu.set(titles[0] if titles else "(no concept)")
        self.stale = True

    def show_sections(self, variant) -> None:
        """The settings of the model's kind of control only (ItemCompanions.control_sections; all while None)."""
        shown = dict(control_sections(variant))
        for path, (box, label) in self.sections.items():
            if path in shown:
                label.configure(text=shown[path])
                box.grid()
            else:
                box.grid_remove()
        self.vace_note.grid() if variant is None or variant.is_vace else self.vace_note.grid_remove()
        if "animate.mode" in self.app.fields:   # only the modes the model trains, and why not the others
            modes, note = animate_mode_choices(variant)
            self.app.fields["animate.mode"].widget.configure(values=modes)
            self.mode_note.configure(text=note)

    def load_items(self) -> None:
        self.loaded, self.stale = False, False
        try:
            config = self.state.config()   # on the main loop: the user may be typing
        except ConfigError as error:
            self.note.configure(text="fix the config first: " + "; ".join(error.problems[:3]))
            return
        index = int(self.concept_menu.get().split(":", 1)[0]) if self.concept_menu.get()[:1].isdigit() else None
        problem = "add a concept on the concepts tab to preview its items" if index is None else \
            f"data.concepts.{index}.path: {config.data.concepts[index].path!r} does not exist" \
            if not Path(config.data.concepts[index].path).exists() else ""
        self.note.configure(text=problem or "scanning…")

        def work():   # no Tk call in this thread
            variant = viewer_variant(config)
            return variant, [] if problem else browser.browse(config, index, variant)

        def show(result):
            if isinstance(result, Exception):
                self.note.configure(text=f"cannot list the concept: {result}")
                return
            variant, self.items = result
            self.show_sections(variant)
            if problem:
                return
            self.kind = kind_of(variant)
            self.loaded = True
            names = [Path(item.path).name for item in self.items] or [NO_ITEMS]
            self.item_menu.configure(values=names)
            self.item_menu.set(names[0])
            self.choose(names[0])

        in_worker(self.note, work, show, "control-browse")

    def choose(self, name: str) -> None:
        item = next((item for item in self.items if Path(item.path).name == name), None)
        if item is None:
            self.strip.show(None, [], 1)
            return
        if not self.kind:
            self.note.configure(text="the chosen model takes no control (not a VACE, Wan-Fun Control or Animate "
                                     "model, or none chosen and no model.intended_variant): the item alone is shown")
        else:
            self.note.configure(text=(f"skipped: {item.skip_reason}" if item.skipped else
                                      f"{len(item.companions)} companion(s); the frame slider moves them all"))
        self.strip.show(item.path, item.companions, item.frames or 1)
