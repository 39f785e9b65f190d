from fitgpt.cli import main

raise SystemExit(main())
