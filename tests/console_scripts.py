"""The console scripts the tests run, found where this interpreter's environment installs
them (a virtual environment run without activating it has them off ``PATH``), else on
``PATH``."""
import os
import shutil
import sysconfig


def installed_command(*names: str) -> str | None:
    """The path of the first of ``names`` installed beside this Python or on ``PATH``."""
    path = os.pathsep.join(filter(None, (sysconfig.get_path("scripts"),
                                         os.environ.get("PATH"))))
    return next(filter(None, (shutil.which(name, path=path) for name in names)), None)
