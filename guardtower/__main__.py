from guardtower.cli import main

raise SystemExit(main())
