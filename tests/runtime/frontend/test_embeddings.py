"""Pooling as the model folder says (sentence-transformers' modules.json), process-free."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.runtime.frontend.embeddings import Pooling

ROWS = [[3.0, 4.0, 0.0], [0.0, 0.0, 2.0], [1.0, 2.0, 2.0]]


def _folder(tmp_path, pooling: dict | None, normalize: bool):
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        modules.append({"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return str(tmp_path)


@pytest.mark.parametrize("config, normalize, want", [
    ({"pooling_mode_lasttoken": True}, True, np.array([1.0, 2.0, 2.0]) / 3),
    ({"pooling_mode_mean_tokens": True}, False, np.array([4.0, 6.0, 4.0]) / 3),
    ({"pooling_mode_cls_token": True}, True, np.array([0.6, 0.8, 0.0])),
])
def test_pooling_follows_the_model_folder(tmp_path, config, normalize, want):
    pooling = Pooling.of_model(_folder(tmp_path, config, normalize))
    assert np.allclose(pooling.pool(ROWS), want)


def test_without_sentence_transformers_files_last_token_normalized(tmp_path):
    assert Pooling.of_model(str(tmp_path)) == Pooling("last", True) == Pooling.of_model(None)
    assert np.allclose(Pooling().pool(ROWS, dimensions=2), np.array([1.0, 2.0]) / np.sqrt(5))


def test_two_pooling_modes_at_once_are_refused(tmp_path):
    with pytest.raises(ValueError, match="pooling"):
        Pooling.of_model(_folder(tmp_path, {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, True))
