"""A concept's dataset viewer and caption editor (modules/ui/DatasetBrowser.py): the items on the left (search by
caption, filter by bucket or skipped), the chosen one on the right: first / middle / last frame, frames, fps,
resolution bucket, skip reason, and its caption in an editable box that Save writes next to the clip. For a VACE
or Animate model, the item's companions (control, mask, references; pose, face, reference, background, mask) play
beside it on one frame slider (CtkCompanionStrip), and a missing one says so."""
from __future__ import annotations

import threading
from pathlib import Path

import customtkinter as ctk

from modules.ui import DatasetBrowser as browser
from modules.ui.ctk_components import button, thumbnail_image
from modules.ui.CtkCompanionStrip import CtkCompanionStrip
from modules.util.config.config_io import ConfigError
from modules.util.video_io import UnreadableMediaError

ALL = "(all buckets)"
SKIP_FILTER = {"all items": None, "kept": False, "skipped": True}


class CtkDatasetWindow(ctk.CTkToplevel):
    def __init__(self, app, index: int):
        super().__init__(app)
        self.app, self.index = app, index
        self.title(f"dataset: {app.concepts.title(index)}")
        self.geometry("1100x720")
        self.transient(app)
        self.grid_columnconfigure(1, weight=1)
        self.grid_rowconfigure(1, weight=1)
        bar = ctk.CTkFrame(self, fg_color="transparent")
        bar.grid(row=0, column=0, columnspan=2, sticky="ew", padx=6, pady=4)
        self.search = ctk.CTkEntry(bar, width=260, placeholder_text="search captions")
        self.search.grid(row=0, column=0, padx=4)
        self.search.bind("<KeyRelease>", lambda _e: self.show_list())
        self.bucket_menu = ctk.CTkOptionMenu(bar, values=[ALL], width=160, command=lambda _v: self.show_list())
        self.bucket_menu.grid(row=0, column=1, padx=4)
        self.skip_menu = ctk.CTkOptionMenu(bar, values=list(SKIP_FILTER), width=120, command=lambda _v: self.show_list())
        self.skip_menu.grid(row=0, column=2, padx=4)
        self.count_label = ctk.CTkLabel(bar, text="scanning…", anchor="w")
        self.count_label.grid(row=0, column=3, padx=8)
        self.listing = ctk.CTkScrollableFrame(self, width=300)
        self.listing.grid(row=1, column=0, sticky="nsw", padx=6, pady=6)
        detail = ctk.CTkFrame(self)
        detail.grid(row=1, column=1, sticky="nsew", padx=6, pady=6)
        detail.grid_columnconfigure(0, weight=1)
        self.thumbs = ctk.CTkFrame(detail, fg_color="transparent")
        self.thumbs.grid(row=0, column=0, sticky="w", padx=6, pady=6)
        self.strip = CtkCompanionStrip(detail, row=1, panel=118)
        self.strip.frame.grid_remove()
        self.info = ctk.CTkLabel(detail, text="", anchor="w", justify="left")
        self.info.grid(row=2, column=0, sticky="w", padx=6)
        self.caption = ctk.CTkTextbox(detail, height=140, wrap="word")
        self.caption.grid(row=3, column=0, sticky="ew", padx=6, pady=6)
        self.save_button = button(detail, "Save caption", self.save, width=130)
        self.save_button.grid(row=4, column=0, sticky="w", padx=6)
        self.items: list[browser.DatasetItem] = []
        self.shown: list[browser.DatasetItem] = []
        self.current: browser.DatasetItem | None = None
        self._buttons: dict[str, ctk.CTkButton] = {}   # item path -> its entry in the list
        self._images = []
        self.loaded = False
        self.protocol("WM_DELETE_WINDOW", self.close)
        self.load()

    def load(self) -> None:
        try:
            config = self.app.config_state.config()   # on the main loop: the user may be typing
        except ConfigError as error:
            self.count_label.configure(text="; ".join(error.problems))
            return
        done: list = []

        def work():  # no Tk call in this thread
            from modules.ui.ItemCompanions import viewer_variant
            try:
                done.append(browser.browse(config, self.index, viewer_variant(config)))
            except Exception as error:  # noqa: BLE001  shown in the window
                done.append(error)

        def wait():
            if not self.winfo_exists():
                return
            if not done:
                self.after(100, wait)
                return
            if isinstance(done[0], Exception):
                self.count_label.configure(text=f"cannot list the concept: {done[0]}")
                return
            self.items = done[0]
            buckets = sorted({item.bucket for item in self.items if item.bucket})
            self.bucket_menu.configure(values=[ALL] + buckets)
            self.loaded = True
            self.show_list()

        threading.Thread(target=work, name="dataset-browse", daemon=True).start()
        self.after(100, wait)

    def show_list(self) -> None:
        bucket = self.bucket_menu.get()
        self.shown = browser.select(self.items, self.search.get(), "" if bucket == ALL else bucket,
                                    SKIP_FILTER[self.skip_menu.get()])
        for child in self.listing.winfo_children():
            child.destroy()
        self._buttons = {}
        for row, item in enumerate(self.shown[:500]):
            text = ("⚠ " if item.skipped else "") + Path(item.path).name
            self._buttons[item.path] = ctk.CTkButton(self.listing, text=text, anchor="w", width=280,
                                                     fg_color="transparent", command=lambda i=item: self.choose(i))
            self._buttons[item.path].grid(row=row, column=0, sticky="w")
        self._mark_current()
        self.count_label.configure(text=f"{len(self.shown)} of {len(self.items)} items")
        if self.shown and (self.current is None or self.current not in self.shown):
            self.choose(self.shown[0])

    def edited(self) -> bool:
        """The caption box holds an edit of the current item's sidecar caption that is not saved."""
        return bool(self.current is not None and self.current.caption_file and
                    self.caption.get("1.0", "end").strip() != self.current.caption.strip())

    def _mark_current(self) -> None:
        for path, entry in self._buttons.items():
            chosen = self.current is not None and path == self.current.path
            entry.configure(fg_color=ctk.ThemeManager.theme["CTkButton"]["fg_color"] if chosen else "transparent")

    def choose(self, item: browser.DatasetItem) -> None:
        # an edit is kept when another item is chosen (it was lost silently): saved as Save caption does
        if item is not self.current and self.edited() and not self.save(refresh=False):
            return
        self.current = item
        self._mark_current()
        for child in self.thumbs.winfo_children():
            child.destroy()
        self._images = []
        if item.companions:   # the target plays on the strip's slider beside its companions
            self.thumbs.grid_remove()
            self.strip.frame.grid()
            self.strip.show(item.path, item.companions, item.frames or self._frame_count(item))
            frames = []
        else:
            self.strip.frame.grid_remove()
            self.thumbs.grid()
            try:
                frames = browser.thumbnails(item)
            except (UnreadableMediaError, OSError, ValueError) as error:  # its reason is shown instead of pictures
                frames, item.skip_reason = [], item.skip_reason or str(error)
        for column, frame in enumerate(frames):
            picture = thumbnail_image(frame, 200)
            self._images.append(picture)
            ctk.CTkLabel(self.thumbs, image=picture, text="").grid(row=0, column=column, padx=3)
        fps = f"{item.fps:.3g}" if item.fps else "unknown"
        lines = [item.path, f"frames {item.frames}, fps {fps}, {item.width}x{item.height}",
                 f"bucket (frames x width x height): {item.bucket or '-'}"]
        if item.skipped:
            lines.append(f"skipped: {item.skip_reason}")
        if item.companions:
            lines.append("companions: " + "; ".join(companion.text for companion in item.companions))
        lines.append(f"caption file: {item.caption_file or '(not a file: see the concept caption source)'}")
        self.info.configure(text="\n".join(lines))
        self.caption.delete("1.0", "end")
        self.caption.insert("end", item.caption)
        self.save_button.configure(state="normal" if item.caption_file else "disabled")

    @staticmethod
    def _frame_count(item: browser.DatasetItem) -> int:
        """A skipped item was not probed by the pipeline: its own count, when it reads."""
        from modules.ui.ItemCompanions import frame_count
        try:
            return frame_count(item.path)
        except (UnreadableMediaError, OSError, ValueError):
            return 1

    def save(self, refresh: bool = True) -> bool:
        if self.current is None:
            return False
        try:
            browser.save_caption(self.current, self.caption.get("1.0", "end"))
        except (ValueError, OSError) as error:
            self.app.show_dialog("Caption not saved", str(error))
            return False
        self.app.log(f"caption saved: {self.current.caption_file} (the next run encodes the new text)")
        if refresh:
            self.show_list()
        return True

    def close(self) -> None:
        """The window's close button: an unsaved edit is saved first (a failed save keeps the window open)."""
        if self.edited() and not self.save(refresh=False):
            return
        self.destroy()
