"""The toy world: procedurally generated visual questions where writing Python genuinely helps.

Small enough for a ~1M-parameter Qwen2.5-VL (`toy_model_config`: vision 2 x 64, decoder 4 x 128,
a ~1k-token BPE) to learn from scratch in CPU minutes, and real enough to exercise the whole stack:
SFT on expert trajectories whose code ran in the sandbox, GRPO on RL prompts, evaluation on
held-out prompts.

Three task families (`tasks.py`), each easy or hard:

- **count**: easy = 1-3 big shapes, each filling most of its quadrant ("How many shapes are in the image?");
  hard = 6-14 small shapes of 4 colours and 3 kinds ("How many red circles are in the image?").
- **bars**: easy = a red and a blue bar of very different heights ("Which bar is taller, ...?");
  hard = 5-7 bars whose tallest is 1-3 px above the next ("Which colour is the tallest bar?" or
  "How many pixels tall is the tallest bar?").
- **find**: easy = a large shape in a black box filling the image ("What colour is the shape
  inside the marked box?"); hard = a 14-18 px box among grey clutter and decoys of other colours.

Easy items are answerable by sight: large, high-contrast, few objects, few answer classes. Hard
items are not: pixel-exact heights, many small look-alike shapes, a tiny box among decoys. With
code they are trivial (a colour mask and connected components; per-colour row counts; crop and
enlarge the marker, then look at the crop that comes back as an observation image). So a policy
does best by answering easy items directly and writing code for hard ones.

The SFT data does not show that optimum. With probability `easy_code_rate` (default 0.3) the expert
also solves an easy item of a family in `easy_code_families` (default: all) with code (all
non-white connected components for `count`, the bar-height template for `bars`, crop and enlarge
for `find`; bug-free, short think texts), so the SFT model behaves like a cold-start policy that
over-uses tools. A choice drawn at random for every item is learned as a minority mode that greedy
decoding never takes; restricting it to some families (visible in the question) at a rate above
one half makes it the majority mode there, so greedy decoding reproduces it and sampling still
answers some of those items directly (the demo: count and bars at 0.75). This is what the paper's *adaptive tool
use* needs: RL with the R_BAT reward should lower the tool-call rate on easy items relative to
the SFT model while keeping it high on hard ones. A world where easy items never used code would
leave RL nothing to lower. world.json records the rate and the number of easy SFT items with code.

Pieces: `make_item` / `verify_item` (generators and an independent pixel check), `expert_trajectory`
(scripted SFT trajectories executed in a real `SandboxPool`), `write_toy_processor_files` /
`toy_model_config` (the toy tokenizer with Qwen's special tokens, and the model preset),
`generate_world` / `load_prompts` (everything on disk, deterministic per seed).
"""

from data.toyworld.expert import ExpertError, expert_code, expert_trajectory, user_content
from data.toyworld.tasks import (
    ANSWER_COLORS,
    DIFFICULTIES,
    FAMILIES,
    KINDS,
    PALETTE,
    Item,
    make_item,
    verify_item,
)
from data.toyworld.tokenizer import toy_model_config, train_tokenizer, write_toy_processor_files
from data.toyworld.world import generate_world, load_prompts

__all__ = [
    "ANSWER_COLORS",
    "DIFFICULTIES",
    "FAMILIES",
    "KINDS",
    "PALETTE",
    "ExpertError",
    "Item",
    "expert_code",
    "expert_trajectory",
    "generate_world",
    "load_prompts",
    "make_item",
    "toy_model_config",
    "train_tokenizer",
    "user_content",
    "verify_item",
    "write_toy_processor_files",
]
