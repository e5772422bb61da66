"""What the window remembers between sessions (modules/ui/ui_prefs.py), without a display."""
from modules.ui.ui_prefs import DEFAULT_GEOMETRY, UIPrefs, line_level, shown_at


def test_prefs_survive_a_restart_and_a_damaged_file_gives_the_defaults(tmp_path):
    path = tmp_path / "ui" / "prefs.json"
    prefs = UIPrefs(geometry="1500x1000+10+20", appearance="light", has_run=True,
                    interrupted_config="workspace/run/run-configs/x.json", log_level="WARNING")
    path.parent.mkdir()
    prefs.write(path)
    assert UIPrefs.read(path) == prefs
    path.write_text('{"geometry": "900x700", "from_a_newer_version": 1}')
    assert UIPrefs.read(path) == UIPrefs(geometry="900x700")   # unknown keys are ignored
    path.write_text("{not json")
    assert UIPrefs.read(path) == UIPrefs() and UIPrefs().geometry == DEFAULT_GEOMETRY
    assert UIPrefs.read(tmp_path / "missing.json") == UIPrefs()


def test_log_lines_are_filtered_by_their_level():
    assert line_level("WARNING modules.x: y") == "WARNING" and line_level("CRITICAL z") == "ERROR"
    assert line_level("training started: 200 steps") == "INFO"
    assert line_level("Traceback (most recent call last):") == "ERROR"
    assert shown_at("ERROR a", "WARNING") and not shown_at("INFO a", "WARNING") and shown_at("DEBUG a", "DEBUG")
    assert shown_at("INFO a", "no such level")   # an unknown filter shows INFO and above


def test_a_remembered_window_fits_the_screen_it_opens_on():
    from modules.ui.ui_prefs import fit_geometry
    assert fit_geometry("1500x1000+100+50", 1920, 1080) == "1500x1000+100+50"         # as it was
    assert fit_geometry("2500x1400+1800+900", 1366, 768) == "1366x768+0+0"             # from a larger monitor
    assert fit_geometry("1280x900+-40+-10", 1920, 1080) == "1280x900+0+0"             # partly off the left edge
    assert fit_geometry("1280x900+1000+500", 1920, 1080) == "1280x900+640+180"        # partly off the right edge
    assert fit_geometry("1280x900", 1024, 768) == "1024x768"
    assert fit_geometry("not a geometry", 1920, 1080) == DEFAULT_GEOMETRY
