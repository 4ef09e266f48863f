"""Model and dataset conformance over every registered family and dataset (gemzoo.testing.models)."""

import torch

from gemzoo.testing.models import check_dataset, check_model


def test_dataset(dataset_name, tmp_path):
    check_dataset(dataset_name, tmp_path)


def test_model_builds_on_meta_and_steps(model_name, tmp_path):
    torch.set_num_threads(1)  # tiny ops on a busy 2-core machine
    check_model(model_name, tmp_path)
