"""curves.png: one panel per logged term, laid out in a grid that stays readable at normal size."""

import json

import matplotlib.image

from hf_hyperdflash.training.curves import DPI, PANEL_INCHES, grid_shape, plot_curves


def test_grid_is_at_most_three_columns_and_grows_in_rows():
    expected = {1: (1, 1), 2: (1, 2), 3: (1, 3), 4: (2, 3), 6: (2, 3), 7: (3, 3), 9: (3, 3), 10: (4, 3)}
    shapes = {panels: grid_shape(panels) for panels in expected}
    assert shapes == expected
    for panels, (rows, columns) in shapes.items():
        assert rows * columns >= panels > (rows - 1) * columns  # no empty row


def test_curves_png_is_a_grid_of_panels(tmp_path):
    terms = ["loss", "ce", "kl", "acc", "acc_1", "acc_2", "tau_forced", "tau"]  # what drafter training logs
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": step, **dict.fromkeys(terms, 1.0 / step)}) + "\n" for step in (1, 2)))
    png = plot_curves({"drafter": log}, tmp_path / "curves.png")
    height, width = matplotlib.image.imread(png).shape[:2]
    rows, columns = grid_shape(len(terms))
    assert (rows, columns) == (3, 3)
    assert (width, height) == (round(PANEL_INCHES[0] * columns * DPI), round(PANEL_INCHES[1] * rows * DPI))
