from blockspec.runtime.frontends.cli import main

main()
