"""`make demo-s3`: the demo against a real S3 server (SeaweedFS on loopback), then a "new node".

1. Start SeaweedFS on free loopback ports; credentials go to the ranks through the standard
   AWS_* environment variables (never into manifests or logs).
2. Run examples/demo.py with its runs under s3://demo/.
3. Node loss: a job stopped by an incident is resumed by fresh processes with empty local
   folders, from S3 alone, and ends with the clean run's fingerprint.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

import s3fs  # noqa: E402
import seaweed  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        handle = seaweed.start(tmp)
        try:
            print(f"SeaweedFS S3 on {handle.endpoint_url} (started in {handle.startup_s:.1f} s)")
            os.environ.update(handle.env)
            s3fs.S3FileSystem(**handle.storage_options()).mkdir("demo")
            os.environ["VCKPT_DEMO_URL"] = "s3://demo"
            import demo

            import ddp_train

            code = demo.main()
            print("\nnode loss: stop a job on an incident, then resume it in fresh processes from S3 alone")
            common = ["--world-size", "3", "--steps", "40", "--save-every", "10", "--audit-every", "5",
                      "--consensus-every", "5", "--run", "s3://demo/node-loss"]
            stopped = ddp_train.run_spawned(ddp_train.parse([*common, "--inject", "grad:2:33:scale=10"]))
            print(f"   stopped at step {stopped['final_step']}: {stopped['incidents'][0]['kind']} "
                  f"naming rank(s) {stopped['incidents'][0]['ranks']}")
            os.chdir(tempfile.mkdtemp(prefix="new-node-"))  # nothing local survives
            resumed = ddp_train.run_spawned(ddp_train.parse([*common, "--resume"]))
            clean = ddp_train.run_spawned(ddp_train.parse([*common[:-1], "s3://demo/node-loss-clean"]))
            same = resumed["fingerprint"] == clean["fingerprint"]
            print(f"   resumed on the new node to step {resumed['final_step']}: {resumed['fingerprint']}")
            print(f"   clean run:                         {clean['fingerprint']}")
            print("   bitwise identical" if same else "   MISMATCH")
            return code or (0 if same else 1)
        finally:
            seaweed.stop(handle)


if __name__ == "__main__":
    sys.exit(main())
