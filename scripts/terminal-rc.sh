# The shell of JupyterLab's terminal (File > New > Terminal), as ./book.sh starts it.
# JupyterLab would otherwise start a login shell, whose /etc/profile resets PATH, so `labkit`
# (in .venv/bin) would not be found. This runs your own ~/.bashrc, then puts the book's
# environment first on PATH and starts in the repository's root.
[ -f ~/.bashrc ] && source ~/.bashrc
_book_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$_book_root/.venv/bin/activate"
cd "$_book_root"
unset _book_root
