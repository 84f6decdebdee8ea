# Sourced by the dependency scripts of frameworks that need Python 3.12: `python312` prints one that runs (a pyenv
# shim answers `command -v` without one being selected), or nothing.
python312() {
  local candidate
  for candidate in python3.12 $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null); do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}
