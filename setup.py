"""Package discovery for the one `rankguard.*` namespace (metadata lives in pyproject.toml).

Each top folder is mapped to `rankguard.<folder>`; setuptools cannot prefix what
`[tool.setuptools.packages.find]` discovers, so the subpackages under each mapped folder
are found here, at build time: a new module or subpackage is shipped without being listed.
`deploy/` (systemd units, agent.toml, Slurm scripts, the generated Grafana and Prometheus
files) ships as the package data of `rankguard.deploy` (`rankguard deploy path`).
"""

from setuptools import find_packages, setup

# The top folders of the checkout and the packages they become (only these are mapped).
MAPPED = (
    "contract", "service", "agent", "supervisor", "trainer", "dashboards", "cli", "client", "deploy",
)  # fmt: skip

package_dir = {f"rankguard.{top}": top for top in MAPPED}
packages = []
for top in MAPPED:
    packages.append(f"rankguard.{top}")
    packages += [f"rankguard.{top}.{sub}" for sub in find_packages(top)]

setup(
    package_dir=package_dir,
    packages=packages,
    # Every file under deploy/ (dashboards, rules, units, scripts, example configs).
    package_data={"rankguard.deploy": ["*", "**/*"]},
    exclude_package_data={"rankguard.deploy": ["__pycache__/*", "*.pyc"]},
    include_package_data=False,
)
