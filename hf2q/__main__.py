from hf2q.cli import main

raise SystemExit(main())
