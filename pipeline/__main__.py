from pipeline.entrypoints.cli import main

raise SystemExit(main())
