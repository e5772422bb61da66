"""The tools tab: convert a model, convert or merge a LoRA, sample a model outside training, compare checkpoints x
strengths (then play the result: the sample, or the comparison's first grid).
Each form builds the command line of scripts/convert_model.py, scripts/sample.py or scripts/compare.py and runs that script
(ToolsController), showing its output here and the command to repeat it in a terminal."""
from __future__ import annotations

import json
import tkinter as tk

import customtkinter as ctk
from PIL import Image

from modules.ui import ToolsController as tools
from modules.ui.ToolsController import ACCELERATOR_CHOICES
from modules.ui.ctk_components import EntryText, ask_path, button
from modules.ui.SamplingController import PreviewPlayer

MODEL_FORMATS = ["DIFFUSERS", "ORIGINAL"]
LORA_FORMATS = ["COMFY_LORA", "KOHYA_LORA", "DIFFUSERS_LORA"]
KEEP = "(keep each tensor's)"
DTYPES = [KEEP, "FLOAT_32", "BFLOAT_16", "FLOAT_16", "FLOAT_8"]
# fields that hold paths get a "…" picker: a folder, a file, a new file, or a file added to a comma list
PICKERS = {"base model": "folder", "input": "file", "destination": "save", "e2v config": "file",
           "output dir": "folder", "samples file": "file", "loras": "add", "control video": "file",
           "mask video": "file", "pose video": "file", "face video": "file", "background video": "file",
           "driving video": "file", "reference images": "add", "start image": "file"}
# the sample form's rows for control and character models (ToolsController.CONDITIONS), by the conditions menu
CONDITION_ROWS = {"VACE": ("control video", "mask video", "reference images", "control scale"),
                  "Wan-Fun Control": ("control video", "start image"),
                  "Wan-Fun Control A14B": ("control video", "start image", "mask video"),
                  "Animate": ("reference images", "pose video", "face video", "background video", "mask video",
                              "mode", "continuation frames"),
                  "Animate-2": ("reference images", "driving video", "continuation frames")}
SIZE_HINT = "empty: each sample's own (else 832 x 480 x 81: long on a CPU)"


class CtkToolsView:
    def __init__(self, frame, app):
        self.app, self.frame = app, frame
        self.controller = tools.ToolsController()
        self.values: dict[str, EntryText | tk.StringVar] = {}
        self.rows: dict[str, list] = {}   # form key.name -> its label, widget and picker (conditions hide some)
        self.player = PreviewPlayer()
        self._image = None
        forms = ctk.CTkFrame(frame, fg_color="transparent")
        forms.grid(row=0, column=0, sticky="nw")
        out = ctk.CTkFrame(frame, fg_color="transparent")
        out.grid(row=0, column=1, sticky="nw", padx=8)
        # sampling first: its Run button and the player beside it are in view together
        row = self._form(forms, 0, "sample a model", "sample", [
                         ("base model", "a diffusers folder; empty: the LoRA's"),
                         ("loras", "PATH[:STRENGTH], comma separated"),
                         ("prompt", ""), ("negative prompt", "empty: Wan's default"), ("width", "832"),
                         ("height", "480"), ("frames", "81"), ("steps", "20"), ("guidance", "5.0"), ("seed", "42"),
                         ("accelerator", ACCELERATOR_CHOICES),
                         ("elements", "E2V: {\"name\": \"image path\"}"),
                         ("e2v config", "E2V: only for a model that records none"),
                         ("device", "auto"), ("output dir", "empty: <workspace dir>/tool-samples"),
                         ("conditions", ["none", *CONDITION_ROWS]),
                         ("control video", "VACE, Wan-Fun: a video or folder of frames, at least `frames` long"),
                         ("start image", "Wan-Fun Control: the first frame (a picture); empty: none"),
                         ("mask video", "white = generate (VACE, Fun A14B); the character's mask (Animate replace)"),
                         ("reference images", "VACE: in order, comma separated; Animate, Animate-2: the character"),
                         ("control scale", "VACE: empty: 1.0"),
                         ("pose video", "Animate: the output is as long as it"),
                         ("face video", "Animate: face crops, frame-aligned with the pose"),
                         ("background video", "Animate replace mode: the scene"),
                         ("driving video", "Animate-2: the motion; the output is as long as it"),
                         ("mode", ["animate", "replace"]), ("continuation frames", ["1", "5"])], self.sample)
        self.values["sample.conditions"].trace_add("write", lambda *_a: self.show_conditions())
        self.show_conditions()
        self.rows["sample.base model"][1].bind(
            "<FocusOut>", lambda _e: self.conditions_for_base(self._get("sample.base model")), add="+")
        row = self._form(forms, row, "convert a model", "model", [("input", "a diffusers folder or a .safetensors file"),
                         ("base model", "with a single file: the diffusers folder with the other parts"),
                         ("format", MODEL_FORMATS), ("destination", ""), ("dtype", DTYPES)], self.convert_model)
        row = self._form(forms, row, "convert a LoRA", "lora", [("input", "a LoRA file (any layout the trainer reads)"),
                         ("format", LORA_FORMATS), ("destination", ""), ("dtype", DTYPES)], self.convert_lora)
        row = self._form(forms, row, "merge LoRA files into a model", "merge", [
                         ("base model", "a diffusers folder"), ("loras", "PATH[:STRENGTH], comma separated"),
                         ("format", MODEL_FORMATS), ("destination", ""), ("dtype", DTYPES)], self.merge_lora)
        self._form(forms, row, "compare checkpoints x strengths", "compare", [
                   ("base model", "a diffusers folder"), ("loras", "LoRA files, save or backup folders, comma separated"),
                   ("strengths", "0.5 0.75 1.0"), ("samples file", "a samples JSON or prompt file"),
                   ("prompt", "or one prompt"), ("width", SIZE_HINT), ("height", ""), ("frames", ""),
                   ("steps", ""), ("accelerator", ACCELERATOR_CHOICES), ("device", "auto"),
                   ("output dir", "empty: <workspace dir>/compare (the gallery lists it)")], self.compare)
        self.video_label = ctk.CTkLabel(out, text="a sampled video plays here", width=320, height=320,
                                        fg_color="#111111", text_color="#cccccc")   # black in both modes
        self.video_label.grid(row=0, column=0, sticky="nw", pady=4)
        # beside the result: the control (VACE) or pose (Animate) video it was sampled from, frame by frame
        self.driving_label = ctk.CTkLabel(out, text="", width=320, height=320, fg_color="#111111",
                                          text_color="#cccccc")
        self.driving_player = PreviewPlayer()
        self._driving_image = None
        self._driving = ""
        self.output = ctk.CTkTextbox(out, width=520, height=300, wrap="word")
        self.output.grid(row=1, column=0, columnspan=2, sticky="nw", pady=4)
        self.stop_button = button(out, "Stop the tool", self.stop, width=120, state="disabled")
        self.stop_button.grid(row=2, column=0, sticky="w", pady=4)

    def _form(self, master, row: int, title: str, key: str, fields: list, action) -> int:
        ctk.CTkLabel(master, text=title, font=ctk.CTkFont(weight="bold")).grid(row=row, column=0, columnspan=2,
                                                                              sticky="w", padx=8, pady=(10, 2))
        row += 1
        for name, hint in fields:
            ctk.CTkLabel(master, text=name, anchor="w", width=120).grid(row=row, column=0, sticky="w", padx=8)
            if isinstance(hint, list):
                variable = tk.StringVar(value=hint[0])
                widget = ctk.CTkOptionMenu(master, values=hint, variable=variable, width=300)
            else:
                widget = ctk.CTkEntry(master, width=300, placeholder_text=hint or None)
                variable = EntryText(widget)
                if hint and (hint[0].isdigit() or hint == "auto"):   # a default value, not a hint
                    variable.set(hint)
            self.values[f"{key}.{name}"] = variable
            widget.grid(row=row, column=1, sticky="w", padx=4, pady=1)
            widgets = [master.grid_slaves(row=row, column=0)[0], widget]
            if name in PICKERS:
                widgets.append(button(master, "…", lambda v=variable, k=PICKERS[name]: self._pick(v, k), width=28))
                widgets[-1].grid(row=row, column=2, sticky="w")
            self.rows[f"{key}.{name}"] = widgets
            row += 1
        button(master, "Run", action, width=80).grid(row=row, column=1, sticky="w", padx=4, pady=4)
        return row + 1

    def show_conditions(self) -> None:
        """The sample form shows the condition rows of the model kind chosen in its conditions menu."""
        shown = CONDITION_ROWS.get(self.values["sample.conditions"].get(), ())
        for name in {name for names in CONDITION_ROWS.values() for name in names}:
            for widget in self.rows[f"sample.{name}"]:
                widget.grid() if name in shown else widget.grid_remove()

    def conditions_for_base(self, base: str) -> None:
        """The conditions menu follows the variant of the base model typed or picked (configs only)."""
        from pathlib import Path
        from modules.util.wan_detection import NotAWanModelError, detect_variant_from_folder
        if not base or not Path(base).is_dir():
            return
        try:
            variant = detect_variant_from_folder(base)
        except (NotAWanModelError, ValueError, OSError):
            return
        self.values["sample.conditions"].set(tools.condition_kind(variant))

    def _pick(self, variable: EntryText, kind: str) -> None:
        current = variable.get()
        if kind != "add":
            chosen = ask_path(self.frame, kind, current)
            if chosen:
                variable.set(chosen)
                if variable is self.values.get("sample.base model"):
                    self.conditions_for_base(chosen)
            return
        parts = [part.strip() for part in current.split(",") if part.strip()]
        chosen = ask_path(self.frame, "file", parts[-1].split(":")[0] if parts else "")
        if chosen:
            variable.set(", ".join(parts + [chosen]))

    def _workspace(self, sub: str) -> str:
        """A tool's default output folder, in the configured workspace (the gallery reads <workspace>/compare)."""
        from pathlib import Path
        return str(Path(self.app.config_state.get("workspace_dir") or "workspace") / sub)

    def _get(self, key: str) -> str:
        value = self.values[key].get().strip()
        return "" if value == KEEP else value

    def _loras(self, key: str) -> list[str]:
        return [part.strip() for part in self._get(key).split(",") if part.strip()]

    def _run(self, command: list[str]) -> None:
        if not self.controller.run(command):
            self.app.show_dialog("Tools", "a tool is already running (Stop the tool ends it)")
            return
        self.stop_button.configure(state="normal")
        self.frame._parent_canvas.yview_moveto(0)   # the output and the player are at the top: Run is lower down

    def stop(self) -> None:
        if self.controller.stop():
            self.output.insert("end", "stopped\n")

    def convert_model(self) -> None:
        self._run(tools.convert_model_command(self._get("model.input"), self._get("model.format"),
                                              self._get("model.destination"), self._get("model.base model"),
                                              self._get("model.dtype")))

    def convert_lora(self) -> None:
        self._run(tools.convert_lora_command(self._get("lora.input"), self._get("lora.format"),
                                             self._get("lora.destination"), self._get("lora.dtype")))

    def merge_lora(self) -> None:
        self._run(tools.merge_lora_command(self._get("merge.base model"), self._loras("merge.loras"),
                                           self._get("merge.format"), self._get("merge.destination"),
                                           self._get("merge.dtype")))

    def sample(self) -> None:
        def number(name: str, kind=int):
            text = self._get(f"sample.{name}")
            try:
                return kind(text) if text else 0
            except ValueError:
                return None

        values = {name: number(name) for name in ("width", "height", "frames", "steps", "seed")}
        guidance = number("guidance", float)
        bad = [name for name, value in {**values, "guidance": guidance}.items() if value is None]
        elements_text = self._get("sample.elements")
        try:
            elements = json.loads(elements_text) if elements_text else {}
        except json.JSONDecodeError:
            bad.append("elements (a JSON object: name -> image path)")
            elements = {}
        if bad:
            self.app.show_dialog("Sample", "not a number: " + ", ".join(bad))
            return
        kind = self._get("sample.conditions")
        shown = CONDITION_ROWS.get(kind, ())
        conditions = {name.replace(" ", "-"): self._get(f"sample.{name}") for name in shown
                      if name != "reference images"}
        # the menus always hold a value: only one that is not sample.py's default is given
        if kind == "Animate":
            conditions["mode"] = "" if conditions["mode"] == "animate" else conditions["mode"]
        if kind in ("Animate", "Animate-2"):
            conditions["continuation-frames"] = "" if conditions["continuation-frames"] == "1" else "5"
        image = conditions.pop("start-image", "")   # sample.py's --image: Wan-Fun Control's start image
        accelerator = self._accelerator("sample")
        if accelerator is False:
            return
        self._driving = tools.driving_video(conditions)
        self._run(tools.sample_command(
            self._get("sample.base model"), self._get("sample.prompt"),
            self._get("sample.output dir") or self._workspace("tool-samples"),
            loras=self._loras("sample.loras"), guidance=guidance if self._get("sample.guidance") else None,
            seed=values.pop("seed") if self._get("sample.seed") else -1,
            negative_prompt=self._get("sample.negative prompt"), elements=elements,
            e2v_config=self._get("sample.e2v config"), device=self._get("sample.device") or "auto",
            conditions=conditions, reference_images=self._loras("sample.reference images") if shown else [],
            image=image, accelerator=accelerator, **values))

    def compare(self) -> None:
        try:
            strengths = tools.parse_strengths(self._get("compare.strengths"))
        except ValueError as error:
            self.app.show_dialog("Compare", str(error))
            return
        sizes = {}
        for name in ("width", "height", "frames", "steps"):
            text = self._get(f"compare.{name}")
            if text and not text.isdigit():
                self.app.show_dialog("Compare", f"{name}: {text!r} is not a whole number")
                return
            sizes[name] = int(text) if text else 0
        accelerator = self._accelerator("compare")
        if accelerator is False:
            return
        self._run(tools.compare_command(
            self._get("compare.base model"), self._loras("compare.loras"), strengths,
            self._get("compare.output dir") or self._workspace("compare"),
            samples_file=self._get("compare.samples file"), prompt=self._get("compare.prompt"),
            device=self._get("compare.device") or "auto", accelerator=accelerator, **sizes))

    def _accelerator(self, form: str):
        """The sampling tab's accelerator when the form's menu asks for it (None: none set or asked for); False
        after a dialog naming a value that is not valid."""
        if self._get(f"{form}.accelerator") != ACCELERATOR_CHOICES[0]:
            return None
        try:
            return tools.sampling_accelerator(self.app.config_state)
        except ValueError as error:
            self.app.show_dialog(form.capitalize(), str(error))
            return False

    def poll(self) -> None:
        for kind, payload in self.controller.poll_events():
            if kind == "log":
                self.output.insert("end", f"{payload}\n")
                self.output.see("end")
            elif kind == "done":
                code, written = payload
                self.stop_button.configure(state="disabled")
                self.output.insert("end", f"exit status {code}\n")
                self.output.see("end")
                if code:
                    self.app.show_dialog("Tool failed", f"exit status {code}; see the output on the tools tab")
                videos = [path for path in written if path.endswith(".mp4")]
                if videos:
                    self.play(videos[0], self._driving)

    def play(self, path: str, driving: str = "") -> None:
        """Plays `path`; with `driving` (the control or pose video it was sampled from) that video beside it, on
        the result's frame index (the result is cut to the driving video's frames, as sampling cuts it)."""
        if getattr(self, "_tick_job", None) is not None:
            self.video_label.after_cancel(self._tick_job)  # one play loop, never two at double speed
            self._tick_job = None
        self.player.open(path)
        self.driving_player.frames = None
        if driving:
            from modules.util.video_io import UnreadableMediaError
            try:
                self.driving_player.open(driving)
            except (UnreadableMediaError, OSError, ValueError) as error:
                self.output.insert("end", f"the driving video cannot be shown: {error}\n")
        if self.driving_player.frames is not None:
            self.driving_label.grid(row=0, column=1, sticky="nw", padx=(8, 0), pady=4)
        else:
            self.driving_label.grid_remove()
        self._tick()

    @staticmethod
    def _fitted(frame) -> ctk.CTkImage:
        image = Image.fromarray(frame)
        scale = 320 / max(image.size)
        return ctk.CTkImage(light_image=image, dark_image=image,
                            size=(round(image.size[0] * scale), round(image.size[1] * scale)))

    def _tick(self) -> None:
        frame = self.player.frame
        if frame is None or not self.video_label.winfo_exists():
            return
        self._image = self._fitted(frame)
        self.video_label.configure(image=self._image, text="")
        driving = self.driving_player.frames
        if driving is not None:
            self._driving_image = self._fitted(driving[min(self.player.index, len(driving) - 1)])
            self.driving_label.configure(image=self._driving_image, text="")
        self._tick_job = self.video_label.after(self.player.interval_ms, self._tick) if self.player.tick() else None
