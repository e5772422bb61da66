"""The labelled grid of a checkpoint x strength comparison (docs/compare.md): one row per checkpoint (the base
model first), one column per strength; a header row names the strengths, a left column the checkpoint and its
step. Cells hold the samples' pixels unchanged (scaled up by a whole factor, nearest, when they are too small for a
label), so a cell of the contact sheet is the sample's frame exactly."""
from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

LABEL_WIDTH = 176      # pixels of the left label column
HEADER_HEIGHT = 24     # pixels of the header row
MIN_CELL_WIDTH = 128   # smaller samples are scaled up (nearest) so the labels fit
BACKGROUND = 32        # grey of the label areas and of empty cells
FONT = cv2.FONT_HERSHEY_SIMPLEX


@dataclass
class GridLayout:
    rows: list[list[str]]      # per row: its label lines (checkpoint, step)
    columns: list[str]         # per column: its label (strength)
    cell_height: int           # of the samples, before scaling
    cell_width: int
    scale: int                 # whole-number upscaling of the cells
    title: str = ""            # in the corner above the label column: how the cells ran ("4 steps, accelerated")

    @classmethod
    def create(cls, rows: list[list[str]], columns: list[str], cell_height: int, cell_width: int,
               title: str = "") -> "GridLayout":
        return cls(rows, columns, cell_height, cell_width, max(1, math.ceil(MIN_CELL_WIDTH / cell_width)), title)

    @property
    def cell_size(self) -> tuple[int, int]:
        return self.cell_height * self.scale, self.cell_width * self.scale

    def cell_box(self, row: int, column: int) -> tuple[int, int, int, int]:
        """(top, left, height, width) of a cell in the grid image."""
        height, width = self.cell_size
        return HEADER_HEIGHT + row * height, LABEL_WIDTH + column * width, height, width

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the grid, both even (H.264 yuv420p needs that)."""
        height, width = self.cell_size
        grid_h, grid_w = HEADER_HEIGHT + len(self.rows) * height, LABEL_WIDTH + len(self.columns) * width
        return grid_h + grid_h % 2, grid_w + grid_w % 2

    def to_json(self) -> dict:
        return {"title": self.title, "rows": self.rows, "columns": self.columns, "scale": self.scale,
                "cells": [[list(self.cell_box(r, c)) for c in range(len(self.columns))] for r in range(len(self.rows))]}


def _text(image: np.ndarray, lines: list[str], top: int, left: int, width: int, height: int) -> None:
    """Lines of white text in the box, shrunk until the longest fits its width."""
    scale = 0.4
    while scale > 0.2 and max(cv2.getTextSize(line, FONT, scale, 1)[0][0] for line in lines) > width - 6:
        scale -= 0.05
    line_height = cv2.getTextSize("Ag", FONT, scale, 1)[0][1] + 6
    for k, line in enumerate(lines):
        y = top + 4 + line_height * (k + 1) - 3
        if y > top + height:
            break
        cv2.putText(image, line, (left + 3, y), FONT, scale, (235, 235, 235), 1, cv2.LINE_AA)


def label_image(layout: GridLayout) -> np.ndarray:
    """(H, W, 3) uint8: the grid's labels on the background, cells empty."""
    grid_h, grid_w = layout.size
    image = np.full((grid_h, grid_w, 3), BACKGROUND, dtype=np.uint8)
    if layout.title:
        _text(image, [layout.title], 0, 0, LABEL_WIDTH, HEADER_HEIGHT)
    for column, label in enumerate(layout.columns):
        _, left, _, width = layout.cell_box(0, column)
        _text(image, [label], 0, left, width, HEADER_HEIGHT)
    for row, lines in enumerate(layout.rows):
        top, _, height, _ = layout.cell_box(row, 0)
        _text(image, lines, top, 0, LABEL_WIDTH, height)
    return image


def compose(layout: GridLayout, cells: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """(F, H, W, 3) uint8 grid video from (row, column) -> (F, h, w, 3) uint8 samples; cells not given stay empty.
    Samples with fewer frames hold their last frame."""
    frames = max(video.shape[0] for video in cells.values())
    grid = np.repeat(label_image(layout)[None], frames, axis=0)
    for (row, column), video in cells.items():
        if video.shape[1:3] != (layout.cell_height, layout.cell_width):
            raise ValueError(f"cell ({row}, {column}) is {video.shape[2]}x{video.shape[1]}, the grid's cells are "
                             f"{layout.cell_width}x{layout.cell_height}")
        top, left, height, width = layout.cell_box(row, column)
        scaled = video.repeat(layout.scale, axis=1).repeat(layout.scale, axis=2)
        held = np.concatenate([scaled, np.repeat(scaled[-1:], frames - len(scaled), axis=0)])
        grid[:, top:top + height, left:left + width] = held
    return grid
