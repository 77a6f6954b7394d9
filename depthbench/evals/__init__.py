"""Teacher-forced NLL on coding, STEM and math sets."""
