from plug_asgd.cli.app import app

app()
