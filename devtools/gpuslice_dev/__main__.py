from gpuslice_dev.cli import main

raise SystemExit(main())
