r"""Main job for now: random checkpoint -> orbax -> load -> answer a question about an image.

  python -m launch.ask --workdir=/tmp/codedance_ask
"""

from absl import flags, logging

from launch import runner

flags.DEFINE_string("workdir", "/tmp/codedance_ask", "Where checkpoints, the image and summary.json go.")
flags.DEFINE_string("question", "How many shapes are in this image?", "The question asked about the image.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
    from runs import quickstart

    quickstart.run(flags.FLAGS.workdir, flags.FLAGS.question)


if __name__ == "__main__":
    runner.run(main)
