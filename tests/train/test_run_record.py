"""Which config changes a resumed run accepts (`train.run_record`)."""

from codedance_jax.train import run_record


def test_implementation_choices_may_change_on_resume_but_the_recipe_may_not():
    saved = {"attention": "xla", "remat": "none", "optim.lr": 1e-4, "seed": 0}
    # Attention and remat are how a step is computed, not what: a run resumed with the kernel is the same run.
    now = {"attention": "flash", "remat": "full", "optim.lr": 2e-4, "seed": 0}
    assert run_record.differences(saved, now) == [("optim.lr", 1e-4, 2e-4)]
