import sys
def main(argv=None):
    from . import __version__
    if argv is None: argv = sys.argv[1:]
    if "--version" in argv: print(f"paratrain {__version__}"); return 0
    return 0
