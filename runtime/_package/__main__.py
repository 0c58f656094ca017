from blockspec.runtime.cli import main

main()
