from gpuslice.cli import main

raise SystemExit(main())
