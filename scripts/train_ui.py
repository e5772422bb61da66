"""Opens the trainer's window (customtkinter). The config it saves is what `train.py --config-path` reads.

  train_ui.py                      the last-used config (or the defaults)
  train_ui.py --config-path C.json a config or preset to open with
"""
import argparse
import os
import sys

import _bootstrap  # noqa: F401

NO_DISPLAY = ("train_ui: no display to open the window on (DISPLAY is not set or the X server cannot be reached). "
              "Run it on a desktop session, with ssh -X, or under Xvfb (xvfb-run ./start-ui.sh); the command line "
              "trainer works without one: ./run-cmd.sh train --config-path CONFIG.json")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-path", help="a config or preset JSON to open (instead of the last-used one)")
    return parser.parse_args(argv)


def create_app(config_path: str | None = None, controller=None):
    """The window, ready for mainloop(); raises tkinter.TclError when there is no display."""
    from modules.ui.CtkTrainView import CtkTrainView
    app = CtkTrainView(controller, restore_last_used=config_path is None)
    if config_path:
        app.load_file(config_path)
    return app


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if sys.platform.startswith("linux") and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        print(NO_DISPLAY, file=sys.stderr)
        return 2
    import logging
    import tkinter

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        app = create_app(args.config_path)
    except tkinter.TclError as error:
        print(f"{NO_DISPLAY}\n  ({error})", file=sys.stderr)
        return 2
    app.mainloop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
