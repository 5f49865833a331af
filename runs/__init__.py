"""The run loops: SFT and GRPO `train_and_evaluate(config, workdir)`, an application of the library.

They join the library core (model, rollout, train steps) with data pipelines, the toy world and
evaluation, so they sit above all of them (WORKSPACE.md, "Layers"); `launch/` calls them.
"""
