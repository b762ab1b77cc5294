#!/bin/sh
# Coverage post-processing is not used by this project (`bazel coverage` is not part of CI).
echo "remote_coverage_tools stand-in: coverage report generation is not available offline" >&2
exit 0
